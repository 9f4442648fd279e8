"""Test beds for tests and benchmarks: hosts as Linux network namespaces (:mod:`.netbed`) and a
real Slurm on one machine (:mod:`.slurmbed`). Nothing in the package imports them."""
