"""Type stubs of ``cohort._native``, the PyO3 extension over the ``cohort`` crate.

Everything here is a thin wrapper: collectives, rendezvous, revocation and state sync are
the Rust crate's. Users normally import from ``cohort`` (which re-exports these) and use the
high-level layers (``cohort.elastic``, ``cohort.torch``).

Buffers: every collective takes its buffers in place. A buffer is a C-contiguous, writable
object supporting the buffer protocol (a NumPy array, ``bytearray``, ``memoryview``) or a
contiguous CPU ``torch.Tensor`` (read through ``data_ptr()``; ``torch.bfloat16`` included).
Dtypes: float32, float64, float16, bfloat16 (torch only), int32, int64, uint8. Nothing is
copied between Python and Rust: the collective reads and writes the buffer's own memory.
The GIL is released while a collective or a wait runs.

Errors: failures raise the exceptions of ``cohort.errors`` (``PeerFailedError``,
``TimeoutError``, ``RevokedError``, ``TransportError``, ``JobEndedError``,
``ExcludedError``, ``DivergedError``, ``ControlError``, ``InvalidArgumentError``), built by
the extension with their facts as attributes. Ctrl-C during a blocking call raises
``KeyboardInterrupt`` within 100 ms (the operation is abandoned; the communicator is then
unusable, as after any failure).
"""

from typing import Any, Optional, Sequence, Union, final

from cohort.config import GroupConfig

Buffer = Any  # numpy.ndarray | torch.Tensor | bytearray | memoryview
ReduceOpName = str  # "sum" | "prod" | "min" | "max" | "avg"

__all__ = [
    "__version__",
    "Group",
    "Communicator",
    "Member",
    "Work",
    "Checkpoint",
    "SyncOutcome",
    "KeyValueStore",
    "init_logging",
]

__version__: str

@final
class Member:
    """One member of a generation, as the coordinator formed it."""

    rank: int
    worker_id: str
    host: str
    address: str

@final
class Work:
    """A collective started with ``*_async``; runs on the communicator's worker thread, in
    issue order with every other call of the communicator."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks (GIL released) until the collective completes. Returns True when it
        completed; False when ``timeout`` seconds passed first (it still runs). Raises the
        collective's error (once; later calls raise it again)."""
    def is_completed(self) -> bool: ...

@final
class Communicator:
    """The collectives of one generation. Obtained from ``Group.next_generation()``. After
    any failure it is poisoned: every later call raises the same error. When the
    communicator belongs to a ``Group``, a failure is reported to the coordinator first and
    the exception carries the generation's root cause."""

    rank: int
    size: int
    generation: int
    transport: str  # "tcp" | "shm" | "shm+tcp" | "rdma"
    members: list[Member]

    def allreduce(self, buf: Buffer, op: ReduceOpName = "sum") -> None: ...
    def allreduce_async(self, buf: Buffer, op: ReduceOpName = "sum") -> Work: ...
    def reduce_scatter(self, input: Buffer, output: Buffer, op: ReduceOpName = "sum") -> None:
        """``input`` holds ``size`` equal blocks of ``len(output)`` elements; rank r gets
        the reduction of every rank's block r in ``output``."""
    def reduce_scatter_async(self, input: Buffer, output: Buffer, op: ReduceOpName = "sum") -> Work: ...
    def allgather(self, input: Buffer, output: Buffer) -> None:
        """``output`` holds ``size`` blocks of ``len(input)`` elements; block r is rank r's
        input. ``input`` may be the rank's own block of ``output`` (in place)."""
    def allgather_async(self, input: Buffer, output: Buffer) -> Work: ...
    def broadcast(self, buf: Buffer, root: int = 0) -> None: ...
    def broadcast_async(self, buf: Buffer, root: int = 0) -> Work: ...
    def reduce(self, buf: Buffer, root: int = 0, op: ReduceOpName = "sum") -> None: ...
    def gather(self, input: Buffer, output: Optional[Buffer], root: int = 0) -> None: ...
    def scatter(self, input: Optional[Buffer], output: Buffer, root: int = 0) -> None: ...
    def alltoall(self, input: Buffer, output: Buffer) -> None: ...
    def barrier(self) -> None: ...
    def send(self, buf: Buffer, dst: int) -> None: ...
    def recv(self, buf: Buffer, src: int) -> None: ...
    def report_failure(
        self, reason: str, peer: Optional[int] = None, after: Optional[float] = None, probe: float = 0.2
    ) -> Any:
        """Reports that this generation failed outside cohort's own collectives (torch's gloo
        beneath ``cohort.torch.managed``) and returns the ``CollectiveError`` to raise, whose
        ``cause`` is the generation's root cause as the coordinator recorded it (the first
        report wins: every rank shares it). ``peer`` names the failed rank where the caller
        knows it; else each other member's process is asked whether it runs (cohort's liveness
        probe, up to ``probe`` seconds) and the lowest that does not is named. ``after``
        (seconds) makes it a timeout. The generation is revoked and this communicator aborted.
        Bad arguments raise ``InvalidArgumentError``."""
    def wait_revoked(self, timeout: Optional[float] = None) -> Any:
        """Waits (GIL released) until this generation is revoked or the job ended: returns the
        ``RevokedError`` with the root cause, or None when ``timeout`` seconds passed first."""
    def subgroup(self, ranks: list[int], channel: int) -> Communicator:
        """A communicator over ``ranks`` of this one (its rank i is ``ranks[i]``), sharing
        this one's links, failures and revocation on ``channel`` (1 to 4095); its calls may
        run at the same time as this one's. Every member passes the same ranks and channel;
        subgroups in use at once that share two members need different channels. Closed
        with this communicator."""
    def close(self) -> None:
        """Closes the links (peers see this rank gone). Idempotent."""

@final
class SyncOutcome:
    step: Optional[int]  # the commit every member now holds (None: nothing committed yet)
    source: int  # the rank whose commit was broadcast
    changed: bool  # whether this member's state changed

@final
class Checkpoint:
    """The crate's commit/restore/sync, over opaque snapshot bytes."""

    step: Optional[int]
    digest: bytes  # SHA-256 over step and snapshot

    def __init__(self) -> None: ...
    def commit(self, snapshot: bytes, step: int) -> None: ...
    def snapshot(self) -> bytes:
        """The committed snapshot (what restore loads)."""
    def sync(self, comm: Communicator, current: bytes) -> tuple[bytes, SyncOutcome]:
        """Makes every member hold the newest commit (digests compared). ``current`` is
        this member's state, used when nobody has committed yet. Returns the snapshot to
        load. Raises a collective error (re-form and call again) or ``DivergedError``."""
    def agree(self, comm: Communicator, flags: bytes) -> bytes:
        """A commit point's agreement: ``flags`` max-reduced over the members, in the same
        small allreduce that checks that every member committed the same step with the same
        state. Raises a collective error (re-form) or ``DivergedError`` on every rank."""

@final
class Group:
    """This worker's membership in an elastic job (``ElasticGroup``). Joining happens in
    the constructor; heartbeats and the watch stream run in the background until
    ``leave()``/``close()``. Its configuration is a ``cohort.GroupConfig`` (defaults are
    ``cohort-worker train``'s)."""

    job: str
    worker_id: str
    host: str
    incarnation: int
    address: str  # data-plane address peers dial
    leaving: bool  # SIGTERM received (when handle_sigterm): leave at the next commit point
    reformation_pending: bool  # joiners waiting (as far as this worker has heard)

    config: GroupConfig  # what it joined with

    def __new__(
        cls,
        config: Union[GroupConfig, str],
        coordinator: Optional[Union[str, Sequence[str]]] = None,
        worker_id: Optional[str] = None,
        **options: Any,
    ) -> "Group":
        """Joins (blocks; an excluded worker waits out its exclusion) as ``config`` says.
        ``Group(job, coordinator, worker_id, **options)`` is shorthand for
        ``Group(GroupConfig(job, coordinator, worker_id, **options))`` (the options are
        ``GroupConfig``'s keywords). A bad value raises ``InvalidArgumentError`` before
        anything is sent. SIGTERM while joining raises ``cohort.GracefulLeave`` (exit status 0
        if uncaught)."""
    def next_generation(self) -> Communicator:
        """Waits at the rendezvous for the next generation and connects its mesh (blocks,
        GIL released). Raises ``JobEndedError`` when the job ended. SIGTERM while it waits
        (when handle_sigterm) leaves the job and raises ``cohort.GracefulLeave``."""
    def leave_at_commit_points(self) -> None:
        """The caller reads ``leaving`` at its commit points and leaves there
        (``cohort.elastic``'s states and ``cohort.hsdp`` call it). Without it, SIGTERM makes
        the group's next blocking call (a collective, a ``Work.wait``) leave the job and raise
        ``cohort.GracefulLeave``, within 50 ms for a call already blocked on the main thread."""
    def close_comms(self) -> None:
        """Closes every communicator this group made (what ``leave()`` and ``close()`` do
        first); the group stays a member."""
    def commit(self, generation: int, step: int, digest: bytes) -> bool:
        """Reports a commit point (in the background); returns ``reformation_pending``."""
    def set_progress(self, generation: int, step: int, activity: str) -> None: ...
    def leave(self, finished: bool = False) -> None:
        """Leaves the job (``finished``: the work is done; otherwise a graceful leave). The
        communicators it made are closed first."""
    def close(self) -> None:
        """Stops the background tasks without a leave (the lease expires), and closes the
        communicators it made (they raise ``InvalidArgumentError`` afterwards). Idempotent."""
    def __enter__(self) -> "Group": ...
    def __exit__(self, exc_type: Any, _exc: Any, _tb: Any) -> None: ...

def init_logging(level: str = "warn") -> None:
    """Routes the crate's tracing to stderr (``COHORT_LOG`` overrides). Called at import."""

@final
class KeyValueStore:
    """One scope of a job's key-value store on the coordinator (the ``StoreOp`` RPC): the
    native half of ``cohort.torch.Store``. A bad job id (1..=128 characters of
    ``[A-Za-z0-9._-]``) raises ``InvalidArgumentError`` when it is made. Every call releases
    the GIL; a refused call raises ``InvalidArgumentError`` (nothing changed) or
    ``ControlError``."""

    job: str
    scope: str

    def __new__(
        cls,
        coordinator: Union[str, Sequence[str]],
        job: str,
        *,
        token: Optional[str] = None,
        scope: str = "",
        tls_ca: Optional[str] = None,
        request_timeout: float = 5.0,
        retry_budget: float = 30.0,
    ) -> "KeyValueStore": ...
    def set(self, key: str, value: Union[bytes, str]) -> None: ...
    def get(self, key: str, timeout: float) -> Optional[bytes]:
        """The value, waiting up to ``timeout`` seconds for the key; None if it never came."""
    def add(self, key: str, delta: int) -> int: ...
    def append(self, key: str, value: Union[bytes, str]) -> None: ...
    def compare_set(self, key: str, expected: Union[bytes, str], desired: Union[bytes, str]) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def delete_key(self, key: str) -> bool: ...
    def num_keys(self) -> int: ...
    def wait(self, keys: list[str], timeout: float) -> bool:
        """Whether every key exists, waiting up to ``timeout`` seconds."""
