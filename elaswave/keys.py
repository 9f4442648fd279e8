"""The etcd key layout of a job. Everything of a job lives under ``/elaswave/<job_id>/``."""

from __future__ import annotations

ROOT = "/elaswave/"


class JobKeys:
    """Key names for one job; values are JSON documents unless noted."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.prefix = f"{ROOT}{job_id}/"
        self.hosts = self.prefix + "hosts/"  # hosts/<host_id>: daemon info, under the host lease
        self.workers = self.prefix + "workers/"  # workers/<worker_id>: a ready worker, host lease
        self.departures = self.prefix + "departures/"  # departures/<worker_id>: why it left
        self.leader = self.prefix + "leader"  # host_id of the elected leader, under its lease
        self.plan = self.prefix + "plan"  # the current Plan; written by the leader with a CAS
        self.faults = self.prefix + "faults/"  # faults/<id>: fault requests from inject-fault
        self.progress = self.prefix + "progress"  # last committed step, throughput
        self.incidents = self.prefix + "incidents"  # recent incidents (a bounded JSON list)
        self.done = self.prefix + "done"  # set once the job has committed its last step
        self.config = self.prefix + "config"  # what every host must train
        self.speed = self.prefix + "speed/"  # speed/<host_id>: its workers' compute times, lease
        self.stop = self.prefix + "stop"  # the leader's verdict that ends the job (a reason)

    def host(self, host_id: str) -> str:
        return self.hosts + host_id

    def worker(self, worker_id: str) -> str:
        return self.workers + worker_id

    def fault(self, fault_id: str) -> str:
        return self.faults + fault_id
