"""Running a plan: the one fill loop every writer's regions go through (``fill``), rows
moved between ranks that do not see the same files (``exchange``), and the leaf-by-leaf
comparison ``diff`` and ``--verify`` make (``compare``)."""
