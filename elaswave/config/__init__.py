"""Typed job configuration and its one loader.

Precedence, lowest to highest: dataclass defaults < YAML file < ``ELASWAVE_*`` environment <
command-line flags (:mod:`~elaswave.config.loader`, the only place that reads ``os.environ``).
The sections live by concern: what is trained (:mod:`~elaswave.config.model`), how
(:mod:`~elaswave.config.train`), where (:mod:`~elaswave.config.cluster`), where its curves go
(:mod:`~elaswave.config.observe`), and the job that holds them (:mod:`~elaswave.config.job`).
"""

from elaswave.config.cluster import ElasticConfig, EtcdTLSConfig, Timeouts
from elaswave.config.job import LAUNCH_FLAGS, JobConfig, schema_type
from elaswave.config.loader import (
    ENV_PREFIX,
    cache_dir,
    config_values,
    etcd_credentials,
    load_config,
    state_dir,
)
from elaswave.config.model import DataConfig, ModelConfig
from elaswave.config.observe import LoggingConfig, WandbConfig, check_packages
from elaswave.config.prune import PruneConfig
from elaswave.config.train import DEVICE_KINDS, ParamGroup, TrainConfig

__all__ = [
    "DEVICE_KINDS",
    "ENV_PREFIX",
    "LAUNCH_FLAGS",
    "DataConfig",
    "ElasticConfig",
    "EtcdTLSConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParamGroup",
    "PruneConfig",
    "Timeouts",
    "TrainConfig",
    "cache_dir",
    "WandbConfig",
    "check_packages",
    "config_values",
    "etcd_credentials",
    "load_config",
    "schema_type",
    "state_dir",
]
