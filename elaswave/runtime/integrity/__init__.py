"""State integrity: checksum votes and repairs (verify), the known-good state and rollback
(rollback); pipelines check their copies in ``strategies/pipeline/stageverify``."""
