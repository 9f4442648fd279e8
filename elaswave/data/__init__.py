"""Data as files, without torch: token files (their checks, sizes and writing), which ``launch``
uses before anything starts and the workers' data sets read."""
