"""State integrity: checksum votes and repairs (verify, stageverify), the known-good state and
rollback (rollback)."""
