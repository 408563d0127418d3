//! The small-message lane: messages of up to [`LANE_MAX`] bytes travel in cells of 8-byte
//! words, each word holding 4 bytes of the message and a 4-byte flag (NCCL's LL protocol).
//!
//! Why: on the ring, a receiver learns of a message from the `head` counter, then reads the
//! slot's header, then its payload: three cache lines the sender wrote, each a hand-off
//! between cores, one after the other. Here the receiver polls the message's own first word;
//! when the flag there is the message's, the data beside it came with it, and a small message
//! is one cache line (an 8-byte message and its header: 7 words). No counter is published.
//!
//! Why it is sound with no fence: every word is stored and loaded whole, atomically
//! ([`protocol::put_word`], [`protocol::get_word`]), and carries its own flag, so a word with
//! the expected flag holds that message's 4 bytes, whatever the order in which the words
//! become visible; the receiver takes a message only once every word of it carries the flag.
//! A cell is reused only after the consumer gave it back: it stores the count of consumed
//! messages in `lane_tail` (`Release`, [`protocol::release`]) after its last load of the cell,
//! and the producer writes message `n` only after it saw (`Acquire`, [`protocol::consumed`])
//! a count above `n - LANE_CELLS`, so no load of a message can see a later message's store.
//! The doorbell is the ring's (`consumer_sleeping`, the same store-buffering handshake).
//! `shm::model` checks all of it under loom.
//!
//! Cell layout (word `i` = `flag << 32 | data`, data little-endian):
//!
//! | word | data |
//! |---|---|
//! | 0 | message length in bytes |
//! | 1 | generation (low 32 bits) |
//! | 2, 3, 4 | tag seq, step, signature |
//! | 5.. | the message, 4 bytes a word, the last word zero-padded |
//!
//! Message `n` (the lane's count, from 0) uses cell `n mod LANE_CELLS` and flag
//! `(n + 1) mod 2^32`, so a cell's earlier messages (flags `n + 1 - k LANE_CELLS`) and fresh
//! memory (0) never look like message `n`. Any other flag in the cell is a protocol error, as
//! are a length over [`LANE_MAX`] or the link's maximum and another generation: the peer's
//! words are untrusted.

use super::protocol::{self, Word};
use crate::Tag;

/// Cells per lane (a power of two, so that flags wrap in step with cells).
pub(crate) const LANE_CELLS: u32 = 8;
/// Largest message the lane carries; longer ones take the ring. Measured on the 2-vCPU
/// machine (docs/benchmarks.md): the lane took 0.1-0.2 us off an 8-byte allreduce and tied at
/// 64 bytes, but from 256 bytes (9 cache lines) it lost to the ring (1.8-1.9 against
/// 1.4-1.5 us), and at 1 KiB it took twice the ring's time: a reader that polls the cell's
/// own lines pulls them back while the writer is still filling them, and every word is
/// looked at twice (the look, then the copy), where the ring copies a slot with one
/// `memcpy` after one look at its counter.
pub const LANE_MAX: usize = 64;
/// Header words of a cell.
const HEADER_WORDS: usize = 5;
/// Words per cell: the header and [`LANE_MAX`] bytes, rounded up to whole cache lines.
pub(crate) const CELL_WORDS: usize = (HEADER_WORDS + LANE_MAX / 4).next_multiple_of(8);
/// Bytes per cell.
pub(crate) const CELL_BYTES: usize = CELL_WORDS * 8;
/// Bytes of one direction's lane.
pub(crate) const LANE_BYTES: usize = LANE_CELLS as usize * CELL_BYTES;

/// The flag of message `n`.
fn flag_of(n: u64) -> u32 {
    (n as u32).wrapping_add(1)
}

fn word(flag: u32, data: u32) -> u64 {
    (u64::from(flag) << 32) | u64::from(data)
}

/// Words message of `len` bytes takes.
fn words_for(len: usize) -> usize {
    HEADER_WORDS + len.div_ceil(4)
}

/// A lane message's header, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaneHeader {
    /// The message's length in bytes.
    pub(crate) len: usize,
    /// Its tag.
    pub(crate) tag: Tag,
}

/// Writes message `n` (`data`, at most [`LANE_MAX`] bytes) into `cell`, the words of its
/// cell. The caller must own the cell: it saw ([`protocol::consumed`]) the consumer give back
/// message `n - LANE_CELLS`. The first word goes last, so that a receiver polling it finds
/// the rest already there (on x86 stores become visible in order; elsewhere it waits for
/// them).
pub(crate) fn write<W: Word<Value = u64>>(cell: &[W], n: u64, generation: u64, tag: Tag, data: &[u8]) {
    assert!(data.len() <= LANE_MAX, "message larger than the lane");
    let flag = flag_of(n);
    let mut chunks = data.chunks_exact(4);
    let mut at = HEADER_WORDS;
    for c in chunks.by_ref() {
        protocol::put_word(&cell[at], word(flag, u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        at += 1;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 4];
        last[..rest.len()].copy_from_slice(rest);
        protocol::put_word(&cell[at], word(flag, u32::from_le_bytes(last)));
    }
    let header = [data.len() as u32, generation as u32, tag.seq, tag.step, tag.signature];
    for (i, &h) in header.iter().enumerate().skip(1) {
        protocol::put_word(&cell[i], word(flag, h));
    }
    protocol::put_word(&cell[0], word(flag, header[0]));
}

/// Whether a flag found in the cell of message `n` belongs to an earlier message of the cell
/// (or to fresh memory): then the message is not there yet. Any other flag is garbage.
fn earlier(found: u32, n: u64) -> bool {
    let back = flag_of(n).wrapping_sub(found);
    found == 0 || (back != 0 && back % LANE_CELLS == 0)
}

/// Looks for message `n` in `cell`: `Ok(None)` while any word of it is missing, its header
/// once all are there. `Err` on a flag that is neither `n`'s nor an earlier message's, a
/// length over [`LANE_MAX`] or `max_message`, or another generation.
pub(crate) fn look<W: Word<Value = u64>>(
    cell: &[W],
    n: u64,
    generation: u64,
    max_message: u64,
) -> Result<Option<LaneHeader>, String> {
    let flag = flag_of(n);
    let first = protocol::get_word(&cell[0]);
    let found = (first >> 32) as u32;
    if found != flag {
        return if earlier(found, n) {
            Ok(None)
        } else {
            Err(format!("lane cell of message {n} holds flag {found:#x}, expected {flag:#x} or an earlier one"))
        };
    }
    let len = first as u32;
    if len as usize > LANE_MAX || u64::from(len) > max_message {
        return Err(format!("lane message of {len} bytes (the lane carries at most {LANE_MAX})"));
    }
    let mut header = [len; HEADER_WORDS];
    for (i, w) in cell.iter().enumerate().take(words_for(len as usize)).skip(1) {
        let v = protocol::get_word(w);
        let found = (v >> 32) as u32;
        if found != flag {
            return if earlier(found, n) {
                Ok(None)
            } else {
                Err(format!("lane word {i} of message {n} holds flag {found:#x}, expected {flag:#x}"))
            };
        }
        if i < HEADER_WORDS {
            header[i] = v as u32;
        }
    }
    if header[1] != generation as u32 {
        return Err(format!("lane message from generation {} (low bits) on a generation {generation} link", header[1]));
    }
    Ok(Some(LaneHeader { len: len as usize, tag: Tag::new(header[2], header[3], header[4]) }))
}

/// Copies the payload of message `n`, found complete by [`look`] with length `out.len()`,
/// into `out`. `Err` if a word changed since (the peer wrote a cell it had not got back).
pub(crate) fn read<W: Word<Value = u64>>(cell: &[W], n: u64, out: &mut [u8]) -> Result<(), String> {
    let flag = flag_of(n);
    for (k, dst) in out.chunks_mut(4).enumerate() {
        let v = protocol::get_word(&cell[HEADER_WORDS + k]);
        if (v >> 32) as u32 != flag {
            return Err(format!("lane word {} of message {n} changed while it was read", HEADER_WORDS + k));
        }
        dst.copy_from_slice(&(v as u32).to_le_bytes()[..dst.len()]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    fn cell() -> Vec<AtomicU64> {
        (0..CELL_WORDS).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn messages_round_trip_at_every_length_and_cell_reuse() {
        let c = cell();
        let tag = Tag::new(7, 8, 9);
        for (n, len) in [0usize, 1, 3, 4, 5, 8, 33, 63, LANE_MAX].into_iter().enumerate() {
            let n = n as u64 * u64::from(LANE_CELLS) + 3;
            assert_eq!(look(&c, n, 5, 1 << 20), Ok(None), "nothing yet for {n}");
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + n as usize) as u8).collect();
            write(&c, n, 5, tag, &data);
            assert_eq!(look(&c, n, 5, 1 << 20), Ok(Some(LaneHeader { len, tag })));
            let mut out = vec![0u8; len];
            read(&c, n, &mut out).unwrap();
            assert_eq!(out, data);
        }
    }

    #[test]
    fn a_message_missing_a_word_is_not_there_yet() {
        let c = cell();
        write(&c, 1, 5, Tag::new(1, 2, 3), &[1u8; 40]);
        c[HEADER_WORDS + 3].store(0, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(look(&c, 1, 5, 1 << 20), Ok(None));
    }

    #[test]
    fn garbage_is_refused() {
        let c = cell();
        c[0].store(word(0x1234, 8), std::sync::atomic::Ordering::Relaxed);
        assert!(look(&c, 1, 5, 1 << 20).unwrap_err().contains("flag"));
        write(&c, 1, 5, Tag::new(1, 2, 3), &[1u8; 8]);
        assert!(look(&c, 1, 6, 1 << 20).unwrap_err().contains("generation"));
        assert!(look(&c, 1, 5, 4).unwrap_err().contains("at most"));
        c[0].store(word(flag_of(1), LANE_MAX as u32 + 1), std::sync::atomic::Ordering::Relaxed);
        assert!(look(&c, 1, 5, 1 << 20).unwrap_err().contains("at most"));
        write(&c, 1, 5, Tag::new(1, 2, 3), &[1u8; 8]);
        c[HEADER_WORDS].store(word(0x77, 0), std::sync::atomic::Ordering::Relaxed);
        assert!(look(&c, 1, 5, 1 << 20).unwrap_err().contains("word 5"));
        write(&c, 1, 5, Tag::new(1, 2, 3), &[1u8; 8]);
        c[HEADER_WORDS + 1].store(word(flag_of(1 + u64::from(LANE_CELLS)), 0), std::sync::atomic::Ordering::Relaxed);
        assert!(read(&c, 1, &mut [0u8; 8]).unwrap_err().contains("changed"));
    }
}
