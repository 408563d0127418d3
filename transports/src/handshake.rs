//! The connection handshake every transport runs on its setup stream (a TCP link itself, the
//! shared-memory setup socket, the RDMA bootstrap connection): message encoding (pure) and the
//! two sides' procedures (`dial`, `accept`), written once and generic over the stream.
//!
//! Every handshake message starts with an 8-byte prefix: magic `"CHTH"` (u32 LE), version
//! u8, kind u8, body length u16 LE. Bodies (little-endian):
//!
//! - `HELLO` (kind 1): generation u64, sender rank u32, intended receiver rank u32, world size
//!   u32, nonce `[u8; 32]`, then the job id (UTF-8, 1..=[`MAX_JOB_LEN`] bytes; its length is
//!   the body length minus 52).
//! - `PROOF` (kind 2): verdict u8, 3 zero bytes, `HMAC-SHA256(token, label ‖ hello_dialer ‖
//!   hello_acceptor)` (32 bytes), where the hellos are the exact encoded messages and the
//!   label names the sender's role (`cohort/tcp/v1/dialer` or `.../acceptor`).
//! - `VERDICT` (kind 3): verdict u8, 3 zero bytes.
//! - `REFUSE` (kind 4): code u8, retriable u8, 2 zero bytes, ours u64, theirs u64, then a
//!   UTF-8 explanation of at most [`MAX_REFUSE_TEXT`] bytes.
//!
//! Exchange (D = dialer, the higher rank; A = acceptor):
//! 1. D → A `HELLO`.
//! 2. A's endpoint routes the connection by (job, generation) to the `connect_mesh` waiting
//!    for it, or answers `REFUSE` (bad hello, stale generation, nobody waiting in time, busy).
//!    The waiter answers `HELLO` + `PROOF` (its verdict is always OK here; its MAC proves
//!    the token).
//! 3. D verifies A's MAC in constant time, checks A's hello (job, generation, ranks, world
//!    size) and sends `PROOF` with its verdict and its own MAC.
//! 4. A verifies D's MAC and checks D's hello, then sends `VERDICT`.
//!
//! The link is up when both verdicts are OK. Both sides hold both hellos, so each describes
//! a refusal from its own point of view ("generation mismatch (ours 4, theirs 3)"). The
//! token never crosses the wire; fresh nonces on both sides make every proof single-use.
//! Every read is bounded in size (no message body exceeds [`MAX_BODY`]) and in time.

use crate::wire::{u32_at, u64_at, Rank};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::SocketAddr;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

/// Version of the handshake messages (the prefix's version byte).
pub const VERSION: u8 = 1;

type HmacSha256 = Hmac<Sha256>;

/// Magic number opening every handshake message (`"CHTH"` on the wire).
pub const HS_MAGIC: u32 = u32::from_le_bytes(*b"CHTH");
/// Longest job id accepted in a hello, in bytes.
pub const MAX_JOB_LEN: usize = 256;
/// Longest explanation carried by a refusal, in bytes.
pub const MAX_REFUSE_TEXT: usize = 512;
/// Length of the fixed message prefix.
pub const PREFIX_LEN: usize = 8;
const HELLO_FIXED: usize = 52;
const PROOF_BODY: usize = 36;
const VERDICT_BODY: usize = 4;
const REFUSE_FIXED: usize = 20;
/// Largest body of any handshake message.
pub const MAX_BODY: usize = REFUSE_FIXED + MAX_REFUSE_TEXT;

const KIND_HELLO: u8 = 1;
const KIND_PROOF: u8 = 2;
const KIND_VERDICT: u8 = 3;
const KIND_REFUSE: u8 = 4;

const LABEL_DIALER: &[u8] = b"cohort/tcp/v1/dialer";
const LABEL_ACCEPTOR: &[u8] = b"cohort/tcp/v1/acceptor";

/// A side's verdict on the other's hello, or a refusal code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Everything matches.
    Ok,
    /// The MAC did not verify: the two sides hold different job tokens.
    AuthFailed,
    /// Different job ids.
    JobMismatch,
    /// Different generations.
    GenerationMismatch,
    /// Different world sizes.
    WorldMismatch,
    /// The ranks in the hello are not the ones expected on this connection.
    RankUnexpected,
    /// The hello was malformed (bad magic, version, kind or length).
    Malformed,
    /// Nobody on the endpoint waits for this (job, generation) yet; retry.
    NotReady,
    /// The endpoint holds too many unclaimed connections; retry.
    Busy,
    /// The hello's generation is older than the one the endpoint is forming.
    StaleGeneration,
}

impl Verdict {
    fn code(self) -> u8 {
        match self {
            Self::Ok => 0,
            Self::AuthFailed => 1,
            Self::JobMismatch => 2,
            Self::GenerationMismatch => 3,
            Self::WorldMismatch => 4,
            Self::RankUnexpected => 5,
            Self::Malformed => 6,
            Self::NotReady => 7,
            Self::Busy => 8,
            Self::StaleGeneration => 9,
        }
    }

    fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Self::Ok,
            1 => Self::AuthFailed,
            2 => Self::JobMismatch,
            3 => Self::GenerationMismatch,
            4 => Self::WorldMismatch,
            5 => Self::RankUnexpected,
            6 => Self::Malformed,
            7 => Self::NotReady,
            8 => Self::Busy,
            9 => Self::StaleGeneration,
            _ => return None,
        })
    }

    /// Describes this verdict from the point of view of the side holding `ours`.
    pub fn describe(self, ours: &Hello, theirs: &Hello) -> String {
        match self {
            Self::Ok => "ok".to_owned(),
            Self::AuthFailed => "authentication failed: wrong job token".to_owned(),
            Self::JobMismatch => format!("job mismatch (ours {:?}, theirs {:?})", ours.job, theirs.job),
            Self::GenerationMismatch | Self::StaleGeneration => {
                format!("generation mismatch (ours {}, theirs {})", ours.generation, theirs.generation)
            }
            Self::WorldMismatch => format!("world size mismatch (ours {}, theirs {})", ours.world, theirs.world),
            Self::RankUnexpected => format!(
                "unexpected ranks (expected a connection from rank {} to rank {}, got one from rank {} to rank {})",
                ours.receiver, ours.sender, theirs.sender, theirs.receiver
            ),
            Self::Malformed => "malformed hello".to_owned(),
            Self::NotReady => "no connection set-up for this job and generation is waiting".to_owned(),
            Self::Busy => "endpoint busy".to_owned(),
        }
    }
}

/// The hello each side sends first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Job id.
    pub job: String,
    /// Generation being formed.
    pub generation: u64,
    /// Rank of the side sending this hello.
    pub sender: Rank,
    /// Rank the sender means to reach.
    pub receiver: Rank,
    /// World size of the generation.
    pub world: u32,
    /// Fresh random nonce.
    pub nonce: [u8; 32],
}

impl Hello {
    /// A hello with a fresh random nonce.
    pub fn new(job: &str, generation: u64, sender: Rank, receiver: Rank, world: u32) -> Result<Self, String> {
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| format!("no randomness for the handshake nonce: {e}"))?;
        Ok(Self { job: job.to_owned(), generation, sender, receiver, world, nonce })
    }

    /// Encodes the full message (prefix and body). The job id must already be valid
    /// (1..=[`MAX_JOB_LEN`] bytes).
    pub fn encode(&self) -> Vec<u8> {
        let body = HELLO_FIXED + self.job.len();
        let mut b = Vec::with_capacity(PREFIX_LEN + body);
        b.extend_from_slice(&prefix(KIND_HELLO, body));
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.sender.to_le_bytes());
        b.extend_from_slice(&self.receiver.to_le_bytes());
        b.extend_from_slice(&self.world.to_le_bytes());
        b.extend_from_slice(&self.nonce);
        b.extend_from_slice(self.job.as_bytes());
        b
    }

    fn decode_body(body: &[u8]) -> Result<Self, String> {
        if body.len() <= HELLO_FIXED || body.len() > HELLO_FIXED + MAX_JOB_LEN {
            return Err(format!("hello body of {} bytes (job id must be 1..={MAX_JOB_LEN} bytes)", body.len()));
        }
        let job = std::str::from_utf8(&body[HELLO_FIXED..]).map_err(|_| "job id is not UTF-8".to_owned())?;
        let mut nonce = [0u8; 32];
        nonce.copy_from_slice(&body[20..52]);
        Ok(Self {
            job: job.to_owned(),
            generation: u64_at(body, 0),
            sender: u32_at(body, 8),
            receiver: u32_at(body, 12),
            world: u32_at(body, 16),
            nonce,
        })
    }
}

/// Checks that a job id fits a hello's frame (1..=[`MAX_JOB_LEN`] bytes). This is the wire's
/// bound, not the rule for ids: cohort's elastic worker applies that one
/// (`cohort_proto::ids::check_id`, 1..=128 characters of `[A-Za-z0-9._-]`) when it joins,
/// and the coordinator to every request, so a formed generation's id always fits.
pub fn validate_job(job: &str) -> Result<(), String> {
    if job.is_empty() || job.len() > MAX_JOB_LEN {
        return Err(format!("job id must be 1..={MAX_JOB_LEN} bytes, got {}", job.len()));
    }
    Ok(())
}

/// A refusal sent instead of the acceptor's hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Why.
    pub code: Verdict,
    /// Whether the dialer should try again (the acceptor may not be ready yet).
    pub retriable: bool,
    /// The refuser's value of the field that differs (generation), or 0.
    pub ours: u64,
    /// The dialer's value of that field as received, or 0.
    pub theirs: u64,
    /// Explanation from the refuser's point of view.
    pub text: String,
}

impl Refusal {
    /// Encodes the full message; the text is cut to [`MAX_REFUSE_TEXT`] bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut end = self.text.len().min(MAX_REFUSE_TEXT);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let text = &self.text.as_bytes()[..end];
        let mut b = Vec::with_capacity(PREFIX_LEN + REFUSE_FIXED + text.len());
        b.extend_from_slice(&prefix(KIND_REFUSE, REFUSE_FIXED + text.len()));
        b.extend_from_slice(&[self.code.code(), u8::from(self.retriable), 0, 0]);
        b.extend_from_slice(&self.ours.to_le_bytes());
        b.extend_from_slice(&self.theirs.to_le_bytes());
        b.extend_from_slice(text);
        b
    }

    /// Describes the refusal from the dialer's point of view.
    pub fn describe_for_dialer(&self) -> String {
        match self.code {
            Verdict::GenerationMismatch | Verdict::StaleGeneration => {
                format!("peer refused: generation mismatch (ours {}, theirs {}): {}", self.theirs, self.ours, self.text)
            }
            _ => format!("peer refused: {}", self.text),
        }
    }
}

/// A decoded handshake message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// A hello.
    Hello(Hello),
    /// A MAC proof with the sender's verdict.
    Proof {
        /// The sender's verdict on our hello.
        verdict: Verdict,
        /// The sender's MAC over the transcript.
        mac: [u8; 32],
    },
    /// A final verdict.
    Verdict(Verdict),
    /// A refusal.
    Refuse(Refusal),
}

/// Encodes a `PROOF` message.
pub fn encode_proof(verdict: Verdict, mac: &[u8; 32]) -> [u8; PREFIX_LEN + PROOF_BODY] {
    let mut b = [0u8; PREFIX_LEN + PROOF_BODY];
    b[..PREFIX_LEN].copy_from_slice(&prefix(KIND_PROOF, PROOF_BODY));
    b[PREFIX_LEN] = verdict.code();
    b[PREFIX_LEN + 4..].copy_from_slice(mac);
    b
}

/// Encodes a `VERDICT` message.
pub fn encode_verdict(verdict: Verdict) -> [u8; PREFIX_LEN + VERDICT_BODY] {
    let mut b = [0u8; PREFIX_LEN + VERDICT_BODY];
    b[..PREFIX_LEN].copy_from_slice(&prefix(KIND_VERDICT, VERDICT_BODY));
    b[PREFIX_LEN] = verdict.code();
    b
}

fn prefix(kind: u8, body: usize) -> [u8; PREFIX_LEN] {
    let mut p = [0u8; PREFIX_LEN];
    p[0..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
    p[4] = VERSION;
    p[5] = kind;
    // Bodies are bounded by MAX_BODY < u16::MAX.
    p[6..8].copy_from_slice(&(body as u16).to_le_bytes());
    p
}

fn arr<const N: usize>(s: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(s);
    a
}

/// Validates a message prefix; returns (kind, body length).
pub fn decode_prefix(p: &[u8; PREFIX_LEN]) -> Result<(u8, usize), String> {
    let magic = u32_at(p, 0);
    if magic != HS_MAGIC {
        return Err(format!("bad handshake magic {magic:#010x} (not a cohort peer?)"));
    }
    if p[4] != VERSION {
        return Err(format!("unsupported protocol version {} (ours {VERSION})", p[4]));
    }
    let kind = p[5];
    let len = usize::from(u16::from_le_bytes([p[6], p[7]]));
    check_body_len(kind, len)?;
    Ok((kind, len))
}

/// Checks that a body of `len` bytes fits message `kind`.
fn check_body_len(kind: u8, len: usize) -> Result<(), String> {
    let (min, max) = match kind {
        KIND_HELLO => (HELLO_FIXED + 1, HELLO_FIXED + MAX_JOB_LEN),
        KIND_PROOF => (PROOF_BODY, PROOF_BODY),
        KIND_VERDICT => (VERDICT_BODY, VERDICT_BODY),
        KIND_REFUSE => (REFUSE_FIXED, REFUSE_FIXED + MAX_REFUSE_TEXT),
        k => return Err(format!("unknown handshake message kind {k}")),
    };
    if len < min || len > max {
        return Err(format!("handshake message kind {kind} of {len} bytes (allowed {min}..={max})"));
    }
    Ok(())
}

/// Decodes a message body of kind `kind`. The body's length is checked again here (as
/// [`decode_prefix`] does), so no caller can make the decoder read out of bounds.
pub fn decode_body(kind: u8, body: &[u8]) -> Result<Message, String> {
    check_body_len(kind, body.len())?;
    let bad_verdict = |c: u8| format!("unknown verdict code {c}");
    match kind {
        KIND_HELLO => Hello::decode_body(body).map(Message::Hello),
        KIND_PROOF => {
            let verdict = Verdict::from_code(body[0]).ok_or_else(|| bad_verdict(body[0]))?;
            Ok(Message::Proof { verdict, mac: arr(&body[4..36]) })
        }
        KIND_VERDICT => Verdict::from_code(body[0]).map(Message::Verdict).ok_or_else(|| bad_verdict(body[0])),
        KIND_REFUSE => {
            let code = Verdict::from_code(body[0]).ok_or_else(|| bad_verdict(body[0]))?;
            let text = String::from_utf8_lossy(&body[REFUSE_FIXED..]).into_owned();
            Ok(Message::Refuse(Refusal {
                code,
                retriable: body[1] != 0,
                ours: u64_at(body, 4),
                theirs: u64_at(body, 12),
                text,
            }))
        }
        k => Err(format!("unknown handshake message kind {k}")),
    }
}

/// Why reading or writing a handshake message failed.
#[derive(Debug, thiserror::Error)]
pub enum HsIoError {
    /// The deadline passed.
    #[error("handshake timed out")]
    Timeout,
    /// The socket failed or closed.
    #[error("{}", describe_io(.0))]
    Io(std::io::Error),
    /// The bytes received are not a valid message.
    #[error("{0}")]
    Malformed(String),
}

fn describe_io(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        "connection closed during the handshake".to_owned()
    } else {
        format!("i/o error during the handshake: {e}")
    }
}

/// Reads one message, bounded in size by [`MAX_BODY`] and in time by `deadline`.
///
/// # Cancel safety
/// Not cancel safe: a message partly read is lost; drop the connection instead.
pub async fn read_message<S: AsyncRead + Unpin>(s: &mut S, deadline: Instant) -> Result<Message, HsIoError> {
    let fut = async {
        let mut p = [0u8; PREFIX_LEN];
        s.read_exact(&mut p).await.map_err(HsIoError::Io)?;
        let (kind, len) = decode_prefix(&p).map_err(HsIoError::Malformed)?;
        let mut body = [0u8; MAX_BODY];
        s.read_exact(&mut body[..len]).await.map_err(HsIoError::Io)?;
        decode_body(kind, &body[..len]).map_err(HsIoError::Malformed)
    };
    tokio::time::timeout_at(deadline, fut).await.map_err(|_| HsIoError::Timeout)?
}

/// Writes bytes, bounded in time by `deadline`.
///
/// # Cancel safety
/// Not cancel safe: part of the bytes may have been written; drop the connection instead.
pub async fn write_all<S: AsyncWrite + Unpin>(s: &mut S, bytes: &[u8], deadline: Instant) -> Result<(), HsIoError> {
    let fut = async {
        s.write_all(bytes).await?;
        s.flush().await
    };
    match tokio::time::timeout_at(deadline, fut).await {
        Ok(r) => r.map_err(HsIoError::Io),
        Err(_) => Err(HsIoError::Timeout),
    }
}

/// The MAC a side sends over the transcript of the two encoded hellos (`dialer_side`
/// selects the role label). `None` only if HMAC rejected the key, which it never does for
/// SHA-256 (any key length is accepted).
pub fn proof(token: &[u8], dialer_side: bool, hello_dialer: &[u8], hello_acceptor: &[u8]) -> Option<[u8; 32]> {
    mac_for(token, dialer_side, hello_dialer, hello_acceptor).map(|m| m.finalize().into_bytes().into())
}

/// Verifies the other side's MAC in constant time.
pub fn verify(token: &[u8], dialer_side: bool, hello_dialer: &[u8], hello_acceptor: &[u8], mac: &[u8; 32]) -> bool {
    mac_for(token, dialer_side, hello_dialer, hello_acceptor).is_some_and(|m| m.verify_slice(mac).is_ok())
}

fn mac_for(token: &[u8], dialer_side: bool, hello_dialer: &[u8], hello_acceptor: &[u8]) -> Option<HmacSha256> {
    let mut m = <HmacSha256 as Mac>::new_from_slice(token).ok()?;
    m.update(if dialer_side { LABEL_DIALER } else { LABEL_ACCEPTOR });
    m.update(&(hello_dialer.len() as u64).to_le_bytes());
    m.update(hello_dialer);
    m.update(&(hello_acceptor.len() as u64).to_le_bytes());
    m.update(hello_acceptor);
    Some(m)
}

/// Compares the other side's hello with ours: same job, generation and world size, and the
/// ranks mirror each other (their sender is our receiver and vice versa).
pub fn check_fields(ours: &Hello, theirs: &Hello) -> Verdict {
    if ours.job != theirs.job {
        Verdict::JobMismatch
    } else if ours.generation != theirs.generation {
        Verdict::GenerationMismatch
    } else if ours.world != theirs.world {
        Verdict::WorldMismatch
    } else if theirs.sender != ours.receiver || theirs.receiver != ours.sender {
        Verdict::RankUnexpected
    } else {
        Verdict::Ok
    }
}

/// The acceptor's checks of a dialer's hello: the fields ([`check_fields`]), and a dialer
/// from a rank above this one (rank `i` accepts only from `i + 1..world`). `ours` is the
/// acceptor's hello to that dialer.
pub(crate) fn check_dialer(ours: &Hello, theirs: &Hello) -> Verdict {
    match check_fields(ours, theirs) {
        Verdict::Ok if theirs.sender <= ours.sender || theirs.sender >= ours.world => Verdict::RankUnexpected,
        v => v,
    }
}

/// One side of a connection being set up: what it forms and proves, and when it gives up.
pub(crate) struct Session<'a> {
    /// Job id (already validated).
    pub(crate) job: &'a str,
    /// Generation being formed.
    pub(crate) generation: u64,
    /// This side's rank.
    pub(crate) rank: Rank,
    /// World size of the generation.
    pub(crate) world: u32,
    /// The job token; only MACs derived from it cross the wire.
    pub(crate) token: &'a [u8],
    /// Every read and write of the exchange is bounded by it.
    pub(crate) deadline: Instant,
}

impl Session<'_> {
    fn hello_to(&self, peer: Rank) -> Result<Hello, String> {
        Hello::new(self.job, self.generation, self.rank, peer, self.world)
    }
}

/// The two encoded hellos of an agreed exchange, to which later messages of the set-up may
/// bind (the RDMA queue-pair descriptions do).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transcript {
    /// The dialer's hello as sent.
    pub dialer: Vec<u8>,
    /// The acceptor's hello as sent.
    pub acceptor: Vec<u8>,
}

/// Why [`dial`] failed.
#[derive(Debug)]
pub(crate) enum DialError {
    /// Worth another attempt until the deadline (the connection failed or timed out, the
    /// acceptor was not ready or busy).
    Retry(String),
    /// Final: the peer disagrees, refused for good, or broke the protocol.
    Fatal(String),
}

impl DialError {
    /// The explanation, whichever kind.
    pub(crate) fn into_detail(self) -> String {
        match self {
            Self::Retry(d) | Self::Fatal(d) => d,
        }
    }
}

fn dial_io(e: HsIoError) -> DialError {
    match e {
        HsIoError::Malformed(m) => DialError::Fatal(format!("peer sent an invalid handshake message: {m}")),
        e => DialError::Retry(e.to_string()),
    }
}

/// The dialer's side of the exchange on a connected stream to `peer`: hello, the acceptor's
/// hello and proof, our verdict and proof, the acceptor's verdict. Succeeds only when the
/// acceptor proved the token and its hello matches ours ([`check_fields`]), and it accepted
/// ours.
///
/// # Cancel safety
/// Not cancel safe: dropping it leaves the stream mid-exchange; drop the stream too.
pub(crate) async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: &Session<'_>,
    peer: Rank,
) -> Result<Transcript, DialError> {
    let deadline = me.deadline;
    let ours = me.hello_to(peer).map_err(DialError::Fatal)?;
    let our_bytes = ours.encode();
    write_all(s, &our_bytes, deadline).await.map_err(dial_io)?;
    let theirs = match read_message(s, deadline).await.map_err(dial_io)? {
        Message::Hello(h) => h,
        Message::Refuse(r) if r.retriable => return Err(DialError::Retry(r.describe_for_dialer())),
        Message::Refuse(r) => return Err(DialError::Fatal(r.describe_for_dialer())),
        m => return Err(DialError::Fatal(format!("expected a hello, got {m:?}"))),
    };
    let their_bytes = theirs.encode();
    let their_mac = match read_message(s, deadline).await.map_err(dial_io)? {
        Message::Proof { mac, .. } => mac,
        m => return Err(DialError::Fatal(format!("expected a proof, got {m:?}"))),
    };
    let authentic = verify(me.token, false, &our_bytes, &their_bytes, &their_mac);
    let verdict = if authentic { check_fields(&ours, &theirs) } else { Verdict::AuthFailed };
    let mac = proof(me.token, true, &our_bytes, &their_bytes)
        .ok_or_else(|| DialError::Fatal("HMAC rejected the job token".into()))?;
    write_all(s, &encode_proof(verdict, &mac), deadline).await.map_err(dial_io)?;
    let their_verdict = match read_message(s, deadline).await {
        Ok(Message::Verdict(v)) => v,
        Ok(m) => return Err(DialError::Fatal(format!("expected a verdict, got {m:?}"))),
        // Our own verdict explains a failure better than the acceptor closing on us.
        Err(_) if verdict != Verdict::Ok => return Err(DialError::Fatal(verdict.describe(&ours, &theirs))),
        Err(e) => return Err(dial_io(e)),
    };
    if verdict != Verdict::Ok {
        return Err(DialError::Fatal(verdict.describe(&ours, &theirs)));
    }
    if their_verdict != Verdict::Ok {
        return Err(DialError::Fatal(format!("peer refused: {}", their_verdict.describe(&ours, &theirs))));
    }
    Ok(Transcript { dialer: our_bytes, acceptor: their_bytes })
}

/// Why [`accept`] turned a connection down.
#[derive(Debug)]
pub(crate) struct Refused {
    /// The rank the dialer's hello claimed.
    pub(crate) claimed: Rank,
    /// What went wrong, naming the connection.
    pub(crate) detail: String,
    /// Both sides proved the token, so this is a real disagreement that fails the set-up;
    /// otherwise it is only noted (an unauthenticated stranger cannot fail a set-up).
    pub(crate) fatal: bool,
}

/// The acceptor's side of the exchange, once the dialer's hello (`theirs`) has been read and
/// routed here: our hello and proof, the dialer's verdict and proof, our verdict. The dialer
/// is accepted when its MAC verifies, its hello passes [`check_dialer`], it accepted ours,
/// and `admit(rank)` agrees (called only then; `false` refuses it as [`Verdict::Busy`], a
/// rank already linked). `from` names the connection in explanations.
///
/// # Cancel safety
/// Not cancel safe: dropping it leaves the stream mid-exchange; drop the stream too.
pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    me: &Session<'_>,
    theirs: Hello,
    from: Option<SocketAddr>,
    admit: impl FnOnce(Rank) -> bool,
) -> Result<Transcript, Refused> {
    let deadline = me.deadline;
    let claimed = theirs.sender;
    let (conn, who) = match from {
        Some(a) => (format!("connection from {a} claiming rank {claimed}"), format!("rank {claimed} at {a}")),
        None => (format!("connection claiming rank {claimed}"), format!("rank {claimed}")),
    };
    let noted = |detail: String| Refused { claimed, detail: format!("{conn}: {detail}"), fatal: false };
    let ours = me.hello_to(claimed).map_err(noted)?;
    let our_bytes = ours.encode();
    let their_bytes = theirs.encode();
    let mac =
        proof(me.token, false, &their_bytes, &our_bytes).ok_or_else(|| noted("HMAC rejected the job token".into()))?;
    let mut reply = our_bytes.clone();
    reply.extend_from_slice(&encode_proof(Verdict::Ok, &mac));
    write_all(s, &reply, deadline).await.map_err(|e| noted(e.to_string()))?;
    let (their_verdict, their_mac) = match read_message(s, deadline).await.map_err(|e| noted(e.to_string()))? {
        Message::Proof { verdict, mac } => (verdict, mac),
        m => return Err(noted(format!("expected a proof, got {m:?}"))),
    };
    let authentic = verify(me.token, true, &their_bytes, &our_bytes, &their_mac);
    let mut verdict = if authentic { check_dialer(&ours, &theirs) } else { Verdict::AuthFailed };
    if verdict == Verdict::Ok && their_verdict == Verdict::Ok && !admit(claimed) {
        verdict = Verdict::Busy;
    }
    // Best effort: a failure to deliver the verdict shows up on the dialer's side.
    let _ = write_all(s, &encode_verdict(verdict), deadline).await;
    if verdict != Verdict::Ok {
        let detail = match verdict {
            Verdict::RankUnexpected => format!(
                "{who} dialed rank {}, but rank {} accepts only from ranks {}..{}",
                theirs.receiver,
                me.rank,
                me.rank + 1,
                me.world
            ),
            Verdict::Busy => format!("{who} is already linked"),
            v => format!("{who}: {}", v.describe(&ours, &theirs)),
        };
        return Err(Refused { claimed, detail, fatal: authentic && verdict != Verdict::Busy });
    }
    if their_verdict != Verdict::Ok {
        let detail = format!("{who}: peer refused: {}", their_verdict.describe(&ours, &theirs));
        return Err(Refused { claimed, detail, fatal: true });
    }
    Ok(Transcript { dialer: their_bytes, acceptor: our_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello::new("job-1", 4, 2, 0, 3).unwrap()
    }

    fn round_trip(bytes: &[u8]) -> Message {
        let p: [u8; PREFIX_LEN] = arr(&bytes[..PREFIX_LEN]);
        let (kind, len) = decode_prefix(&p).unwrap();
        assert_eq!(len, bytes.len() - PREFIX_LEN);
        decode_body(kind, &bytes[PREFIX_LEN..]).unwrap()
    }

    #[test]
    fn messages_round_trip() {
        let h = hello();
        assert_eq!(round_trip(&h.encode()), Message::Hello(h.clone()));
        let mac = [7u8; 32];
        assert_eq!(
            round_trip(&encode_proof(Verdict::WorldMismatch, &mac)),
            Message::Proof { verdict: Verdict::WorldMismatch, mac }
        );
        assert_eq!(round_trip(&encode_verdict(Verdict::Ok)), Message::Verdict(Verdict::Ok));
        let r = Refusal { code: Verdict::StaleGeneration, retriable: false, ours: 4, theirs: 3, text: "x".into() };
        assert_eq!(round_trip(&r.encode()), Message::Refuse(r.clone()));
        assert_eq!(r.describe_for_dialer(), "peer refused: generation mismatch (ours 3, theirs 4): x");
    }

    #[test]
    fn prefix_rejects_garbage_and_oversize() {
        assert!(decode_prefix(b"GET / HT").unwrap_err().contains("bad handshake magic"));
        let mut p: [u8; PREFIX_LEN] = arr(&hello().encode()[..PREFIX_LEN]);
        p[6..8].copy_from_slice(&60000u16.to_le_bytes());
        assert!(decode_prefix(&p).unwrap_err().contains("60000 bytes"));
        p[4] = 9;
        assert!(decode_prefix(&p).unwrap_err().contains("version 9"));
    }

    #[test]
    fn refusal_text_is_bounded_on_char_boundary() {
        let r = Refusal { code: Verdict::Busy, retriable: true, ours: 0, theirs: 0, text: "é".repeat(400) };
        let b = r.encode();
        assert!(b.len() <= PREFIX_LEN + MAX_BODY);
        match round_trip(&b) {
            Message::Refuse(got) => {
                assert!(got.text.len() <= MAX_REFUSE_TEXT && got.text.chars().all(|c| c == 'é'))
            }
            m => panic!("unexpected {m:?}"),
        }
    }

    #[test]
    fn proofs_bind_token_role_and_transcript() {
        let d = hello().encode();
        let a = Hello::new("job-1", 4, 0, 2, 3).unwrap().encode();
        let mac = proof(b"secret", true, &d, &a).unwrap();
        assert!(verify(b"secret", true, &d, &a, &mac));
        assert!(!verify(b"other", true, &d, &a, &mac));
        assert!(!verify(b"secret", false, &d, &a, &mac));
        assert!(!verify(b"secret", true, &a, &d, &mac));
    }

    fn session(rank: Rank, generation: u64, token: &[u8]) -> Session<'_> {
        Session {
            job: "job-1",
            generation,
            rank,
            world: 3,
            token,
            deadline: Instant::now() + std::time::Duration::from_secs(10),
        }
    }

    /// Runs the dialer `d` against the acceptor `a` over an in-memory stream.
    async fn exchange(
        d: Session<'_>,
        a: Session<'_>,
        to: Rank,
        admit: bool,
    ) -> (Result<Transcript, DialError>, Result<Transcript, Refused>) {
        let (mut ds, mut as_) = tokio::io::duplex(4096);
        let dialer = async {
            let r = dial(&mut ds, &d, to).await;
            drop(ds);
            r
        };
        let acceptor = async {
            let theirs = match read_message(&mut as_, a.deadline).await {
                Ok(Message::Hello(h)) => h,
                m => panic!("expected a hello, got {m:?}"),
            };
            let r = accept(&mut as_, &a, theirs, None, |_| admit).await;
            drop(as_);
            r
        };
        tokio::join!(dialer, acceptor)
    }

    #[tokio::test]
    async fn dial_and_accept_agree_on_one_transcript() {
        let (d, a) = exchange(session(2, 4, b"tok"), session(0, 4, b"tok"), 0, true).await;
        let (d, a) = (d.unwrap(), a.unwrap());
        assert_eq!((d.dialer, d.acceptor), (a.dialer, a.acceptor));
    }

    #[tokio::test]
    async fn a_wrong_token_fails_both_sides_and_a_stranger_is_only_noted() {
        let (d, a) = exchange(session(2, 4, b"tok"), session(0, 4, b"evil"), 0, true).await;
        assert!(matches!(&d, Err(DialError::Fatal(m)) if m.contains("wrong job token")), "{d:?}");
        let a = a.unwrap_err();
        assert!(!a.fatal && a.claimed == 2 && a.detail.contains("wrong job token"), "{a:?}");
    }

    #[tokio::test]
    async fn a_dialer_from_below_is_refused_and_a_busy_rank_is_not_fatal() {
        // Rank 0 dialing rank 2: the acceptor takes only higher ranks.
        let (d, a) = exchange(session(0, 4, b"tok"), session(2, 4, b"tok"), 2, true).await;
        assert!(matches!(&d, Err(DialError::Fatal(m)) if m.contains("peer refused: unexpected ranks")), "{d:?}");
        let a = a.unwrap_err();
        assert!(a.fatal && a.detail.contains("accepts only from ranks 3..3"), "{a:?}");
        let (d, a) = exchange(session(2, 4, b"tok"), session(0, 4, b"tok"), 0, false).await;
        assert!(matches!(&d, Err(DialError::Fatal(m)) if m.contains("endpoint busy")), "{d:?}");
        let a = a.unwrap_err();
        assert!(!a.fatal && a.detail.contains("already linked"), "{a:?}");
    }

    #[tokio::test]
    async fn a_generation_mismatch_names_both_numbers_on_both_sides() {
        let (d, a) = exchange(session(2, 3, b"tok"), session(0, 4, b"tok"), 0, true).await;
        assert!(matches!(&d, Err(DialError::Fatal(m)) if m == "generation mismatch (ours 3, theirs 4)"), "{d:?}");
        let a = a.unwrap_err();
        assert!(a.fatal && a.detail == "rank 2: generation mismatch (ours 4, theirs 3)", "{a:?}");
    }

    #[test]
    fn field_checks_name_the_difference() {
        let ours = Hello::new("job-1", 4, 0, 2, 3).unwrap();
        let theirs = hello();
        assert_eq!(check_fields(&ours, &theirs), Verdict::Ok);
        let mut t = theirs.clone();
        t.generation = 3;
        assert_eq!(check_fields(&ours, &t), Verdict::GenerationMismatch);
        assert_eq!(Verdict::GenerationMismatch.describe(&ours, &t), "generation mismatch (ours 4, theirs 3)");
        let mut t = theirs.clone();
        t.world = 5;
        assert_eq!(check_fields(&ours, &t), Verdict::WorldMismatch);
        let mut t = theirs.clone();
        t.job = "job-2".into();
        assert_eq!(check_fields(&ours, &t), Verdict::JobMismatch);
        let mut t = theirs;
        t.receiver = 1;
        assert_eq!(check_fields(&ours, &t), Verdict::RankUnexpected);
    }
}
