"""Data as files, without torch, for ``launch`` before anything starts and for the workers' data
sets: token files (:mod:`~elaswave.data.tokens`: their checks, sizes and writing, and
:mod:`~elaswave.data.checks`: what a job's data must pass), and your own text
(:mod:`~elaswave.data.text`: read, tokenized and cached once as a token file)."""
