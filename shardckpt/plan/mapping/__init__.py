"""Architecture mappings: a checkpoint family's tensor names and layouts to Hugging Face's, and back.

``rules`` reads a mapping file (``maps/*.toml`` shipped, or the user's own), ``layout``
applies it to a source's tensors (pure: runs of source elements, the coverage proof),
``reader`` reads the mapped tensors through the source's reader.
"""
