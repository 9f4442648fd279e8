"""ElasWave: elastic-native hybrid-parallel training that survives faults in place."""

__version__ = "0.1.0"
