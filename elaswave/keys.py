"""The etcd key layout of a job. Everything of a job lives under ``/elaswave/<job_id>/``.

That single prefix is what confines a job when etcd has auth on: a role with ``readwrite`` on the
prefix and nothing else, bound to the job's user (:func:`confinement_commands`).
"""

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
        self.delta = self.prefix + "delta"  # the same plan as a change to the one before (hosts
        #                                     follow this small key; same transaction as plan)
        self.faults = self.prefix + "faults/"  # faults/<id>: fault requests from inject-fault
        self.progress = self.prefix + "progress"  # last committed step, throughput
        self.incidents = self.prefix + "incidents"  # recent incidents (a bounded JSON list)
        self.done = self.prefix + "done"  # set once the job has committed its last step
        self.config = self.prefix + "config"  # what every host must train
        self.speed = self.prefix + "speed/"  # speed/<host_id>: its workers' compute times, lease
        self.stop = self.prefix + "stop"  # the leader's verdict that ends the job (a reason)
        self.costs = self.prefix + "costs/"  # costs/<host_id>: its workers' layer seconds, lease
        self.memory = self.prefix + "memory/"  # memory/<host_id>: its workers' bytes, lease
        self.hang = self.prefix + "hang/"  # hang/<host_id>: its hang detector's bounds, lease
        self.evict = self.prefix + "evict/"  # evict/<worker_id>: a replay found it miscomputing
        self.logging = self.prefix + "logging"  # when the job's event stream started (its
        #                                         files' and W&B run's names), set once
        self.starting = self.prefix + "starting"  # host_id of the one host that starts the job
        #                                           (again), under its own lease, until it is in

    def host(self, host_id: str) -> str:
        return self.hosts + host_id

    def worker(self, worker_id: str) -> str:
        return self.workers + worker_id

    def fault(self, fault_id: str) -> str:
        return self.faults + fault_id


def role_name(job_id: str) -> str:
    return f"elaswave-{job_id}"


def confinement_commands(job_id: str, user: str) -> list[list[str]]:
    """The ``etcdctl`` commands (run as etcd's root) that confine ``user`` to ``job_id``'s keys.

    The role gets ``readwrite`` on the job's prefix only; ``user add`` asks for the password
    (a user whose client certificate has CN=user needs none when etcd runs --client-cert-auth).
    """
    prefix = JobKeys(job_id).prefix
    role = role_name(job_id)
    return [
        ["etcdctl", "role", "add", role],
        ["etcdctl", "role", "grant-permission", role, "--prefix=true", "readwrite", prefix],
        ["etcdctl", "user", "add", user],
        ["etcdctl", "user", "grant-role", user, role],
    ]
