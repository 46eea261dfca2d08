"""Planning, pure: which of a source's tree is written (``selection``), cast (``cast``), and
how each rank's rows are batched (``plan``): one frozen ``ConvertPlan``, the same on every rank."""
