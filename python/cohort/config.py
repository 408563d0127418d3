"""``GroupConfig``: everything a :class:`cohort.Group` needs to join a job, in one frozen object.

::

    config = cohort.GroupConfig("job", "http://coordinator:7470", "w0", transport="tcp")
    group = cohort.Group(config)
    retry = dataclasses.replace(config, worker_id="w0-b")

Defaults are ``cohort-worker train``'s (docs/configuration.md lists each one beside its CLI flag).
The object is read once, by ``Group``, which checks every value before anything is bound or
sent: a bad value raises :class:`cohort.InvalidArgumentError` and joins nothing.
``cohort.Group(job, coordinator, worker_id, **options)`` is shorthand for
``cohort.Group(cohort.GroupConfig(job, coordinator, worker_id, **options))``.
"""

import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Literal, Optional, Sequence, Union

__all__ = ["GroupConfig", "Transport"]

Transport = Literal["auto", "tcp", "shm", "rdma"]
"""The data-plane transport names, as ``cohort-worker train --transport`` takes them."""


@dataclass(frozen=True)
class GroupConfig:
    """How a :class:`cohort.Group` joins an elastic job. Times are in seconds."""

    job: str
    """The job id (namespaces everything at the coordinator)."""
    coordinator: Union[str, Sequence[str]]
    """Coordinator endpoints: a comma-separated string or a sequence (any replica serves)."""
    worker_id: Optional[str] = None
    """This worker's stable id; None: ``HOSTNAME-PID``."""
    _: KW_ONLY
    token: Optional[Union[str, bytes]] = field(default=None, repr=False)
    """The job's credential, or the operator secret it derives from (``str`` or UTF-8 ``bytes``);
    left out of ``repr``."""
    host: Optional[str] = None
    """Host name shown in status and root causes; None: this machine's."""
    listen: str = "0.0.0.0:0"
    """Data-plane listen address (port 0: any free port)."""
    advertise: str = "127.0.0.1"
    """Host or IP that peers use to reach this worker (the bound port is added)."""
    transport: Transport = "auto"
    """``"auto"``: shared memory with members on this host, TCP with the others; ``"tcp"``: TCP
    only; ``"shm"``: shared memory only (a generation with a member on another host fails);
    ``"rdma"``: also open an RDMA endpoint (``COHORT_RDMA_DEVICE``, else the first active port)
    and publish it, RDMA when every member did (needs a package built with the ``rdma``
    feature and a device; otherwise ``InvalidArgumentError``)."""
    no_progress_timeout: float = 10.0
    """Ceiling of the learned no-progress deadline per link (the deadline itself with
    ``fixed_deadlines``)."""
    no_progress_floor: float = 0.25
    """Floor of the learned no-progress deadline."""
    late_rank_timeout: float = 1800.0
    """How long a collective waits on a peer whose process runs but is late to it (it still
    computes its step, writes a checkpoint, evaluates, or waits behind such a rank): 30
    minutes, gloo's default. ``no_progress_timeout`` never cuts such a peer; this bound catches
    one that never comes (an endless loop or a deadlock in user code). Unused with
    ``fixed_deadlines``."""
    fixed_deadlines: bool = False
    """True: no learned deadlines (``no_progress_timeout`` as is)."""
    connect_timeout: float = 30.0
    """Bound on connecting one generation's mesh."""
    op_timeout: Optional[float] = None
    """Bound on one whole collective; None: none beyond the per-link deadlines."""
    exclusion_wait: float = 3600.0
    """Longest this worker waits out an exclusion before joining fails."""
    rendezvous_poll: float = 10.0
    """Longest single rendezvous long poll."""
    root_cause_wait: float = 0.5
    """How long a failure waits for the coordinator's root cause before using its own error."""
    algorithm: str = "auto"
    """Allreduce algorithm (as ``--algo``)."""
    segment_bytes: int = 1 << 20
    """Largest pipelining segment of the ring collectives, in bytes (positive). Over TCP a
    call whose blocks would be fewer than 16 segments is cut finer, down to 256 KiB."""
    busy_poll: float = 50e-6
    """Receive busy-poll window before a receive parks (0: off)."""
    tls_ca: Optional[str] = None
    """PEM of the CA that signed the coordinators' certificates (``https://`` endpoints)."""
    request_timeout: float = 5.0
    """Bound on one coordinator request."""
    retry_budget: float = 30.0
    """How long coordinator outages are retried once a coordinator has answered."""
    coordinator_wait: float = 3.0
    """How long to retry while every endpoint refuses the first connection (a wrong address?);
    raise it when the coordinators may start after the workers."""
    heartbeat_relay: Optional[bool] = None
    """Heartbeats and events through the host's relays (one coordinator call for the job's
    workers on this host twice per interval, and one watch stream) or each worker's own; None:
    the relays unless ``COHORT_HEARTBEAT_RELAY`` is ``0`` or ``off`` (as ``--heartbeat-relay``)."""
    relay_dir: Optional[Union[str, os.PathLike[str]]] = None
    """A node-local directory (absolute) for the relays' sockets, shared by the node's processes
    whatever their network namespace: on Kubernetes, a ``hostPath`` mounted into every worker
    pod, so that pods of one rank each share their node's relays (as ``--relay-dir``). None:
    ``COHORT_RELAY_DIR``, else abstract sockets shared within one network namespace."""
    handle_sigterm: bool = True
    """Install a SIGTERM handler: leave at the next commit point (``Group.leaving``)."""
