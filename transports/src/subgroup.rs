//! [`Subgroup`]: some ranks of a generation as a world of their own, over the generation's
//! links.
//!
//! A subgroup is what a 2-D device mesh needs (HSDP: a shard group and a replica group per
//! rank): a communicator over a subset of the generation's ranks. It opens no link of its own.
//! It renumbers the ranks (member `i` of the list is the subgroup's rank `i`) and puts its
//! channel into every tag's sequence number ([`crate::wire::seq_on`]), so its messages and
//! those of the generation's own communicator (channel 0) or of another subgroup cross the
//! same links without ever being taken for each other: a link matches, stashes and judges
//! staleness per channel. The subgroup's operations run concurrently with theirs.
//!
//! What it shares with the generation, on purpose:
//! - its failures: a broken link fails every communicator that uses it, and
//!   [`Transport::abort`] on a subgroup aborts the whole generation's transport (a failed
//!   rank revokes its generation, subgroups included; cohort re-forms the generation);
//! - its error reports: the ranks that [`TransportError`]s name are the generation's ranks,
//!   not the subgroup's, so a failure report names the member that failed;
//! - its deadlines in force and link count, which are the generation's links'.
//!
//! Every member of a subgroup must build it with the same member list (in the same order)
//! and the same channel, and two subgroups that share two members (and so a link) must have
//! different channels while both are in use. Disjoint subgroups (the groups of one mesh
//! dimension) may share a channel.

use crate::wire::{channel_of, seq_on, MAX_CHANNEL, SEQ_MASK};
use crate::{AbortReason, DeadlineInForce, Rank, Tag, Transport, TransportError};
use std::sync::Arc;

/// Some ranks of a generation's transport, renumbered, on their own channel (module docs).
pub struct Subgroup<T: Transport> {
    parent: Arc<T>,
    /// The generation's rank of each subgroup rank.
    members: Arc<[Rank]>,
    /// This process's subgroup rank.
    rank: Rank,
    channel: u32,
}

impl<T: Transport> std::fmt::Debug for Subgroup<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subgroup")
            .field("members", &self.members)
            .field("rank", &self.rank)
            .field("channel", &self.channel)
            .field("generation", &self.parent.generation())
            .finish()
    }
}

impl<T: Transport> Subgroup<T> {
    /// The subgroup of `members` (ranks of `parent`'s generation, subgroup rank `i` being
    /// `members[i]`) on `channel` (`1..=`[`MAX_CHANNEL`]). Fails with
    /// [`TransportError::InvalidArgument`] if the list is empty, repeats a rank, names a
    /// rank outside the generation or leaves out this process's rank, or if the channel is
    /// out of range.
    pub fn new(parent: Arc<T>, members: Vec<Rank>, channel: u32) -> Result<Self, TransportError> {
        if channel == 0 || channel > MAX_CHANNEL {
            return Err(TransportError::InvalidArgument(format!(
                "subgroup channel {channel} out of range (1..={MAX_CHANNEL}; 0 is the generation's own)"
            )));
        }
        let world = parent.world_size();
        let mut seen = vec![false; world as usize];
        for &m in &members {
            match seen.get_mut(m as usize) {
                None => {
                    return Err(TransportError::InvalidArgument(format!(
                        "subgroup member {m} is not a rank of the generation (0..{world})"
                    )))
                }
                Some(true) => return Err(TransportError::InvalidArgument(format!("subgroup member {m} listed twice"))),
                Some(s) => *s = true,
            }
        }
        let own = parent.rank();
        let rank = members.iter().position(|&m| m == own).ok_or_else(|| {
            TransportError::InvalidArgument(format!(
                "subgroup {members:?} leaves out this process (rank {own} of the generation)"
            ))
        })? as Rank;
        Ok(Self { parent, members: members.into(), rank, channel })
    }

    /// The generation's rank of each subgroup rank.
    pub fn members(&self) -> &[Rank] {
        &self.members
    }

    /// The channel its tags carry.
    pub fn channel(&self) -> u32 {
        self.channel
    }

    /// The generation's transport beneath.
    pub fn parent(&self) -> &Arc<T> {
        &self.parent
    }

    /// The generation's rank of subgroup rank `peer`.
    fn global(&self, peer: Rank) -> Result<Rank, TransportError> {
        self.members.get(peer as usize).copied().ok_or_else(|| {
            TransportError::InvalidArgument(format!(
                "peer {peer} out of range for a subgroup of {}",
                self.members.len()
            ))
        })
    }

    /// `tag` on this subgroup's channel. A tag already on another channel is refused: the
    /// communicator above numbers its operations within [`SEQ_MASK`].
    fn on_channel(&self, tag: Tag) -> Result<Tag, TransportError> {
        if channel_of(tag.seq) != 0 {
            return Err(TransportError::InvalidArgument(format!(
                "sequence number {:#x} has channel bits set (a subgroup's communicator numbers within {SEQ_MASK:#x})",
                tag.seq
            )));
        }
        Ok(Tag { seq: seq_on(self.channel, tag.seq), ..tag })
    }
}

impl<T: Transport> Transport for Subgroup<T> {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world_size(&self) -> u32 {
        self.members.len() as u32
    }

    fn generation(&self) -> u64 {
        self.parent.generation()
    }

    /// Sends to subgroup rank `peer` over the generation's link to it.
    ///
    /// # Cancel safety
    /// Not cancel safe, like the generation's transport: dropping it part-way through a
    /// message breaks that link.
    async fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        let (peer, tag) = (self.global(peer)?, self.on_channel(tag)?);
        self.parent.send(peer, tag, data).await
    }

    /// Receives from subgroup rank `peer` over the generation's link to it.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`Subgroup::send`].
    async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        let (peer, tag) = (self.global(peer)?, self.on_channel(tag)?);
        self.parent.recv(peer, tag, buf).await
    }

    /// Receives from subgroup rank `peer` piece by piece, as the generation's transport does.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`Subgroup::send`].
    async fn recv_with<F>(&self, peer: Rank, tag: Tag, scratch: &mut [u8], consume: F) -> Result<(), TransportError>
    where
        F: FnMut(&[u8]) + Send,
    {
        let (peer, tag) = (self.global(peer)?, self.on_channel(tag)?);
        self.parent.recv_with(peer, tag, scratch, consume).await
    }

    /// Aborts the generation's transport: every communicator over it, this one included.
    fn abort(&self, reason: AbortReason) {
        self.parent.abort(reason)
    }

    fn is_aborted(&self) -> bool {
        self.parent.is_aborted()
    }

    fn pipeline_segment(&self) -> Option<usize> {
        self.parent.pipeline_segment()
    }

    /// The deadlines on the generation's links to this subgroup's members (peers named by
    /// their generation's rank, as errors name them).
    fn deadlines_in_force(&self) -> Vec<(Rank, DeadlineInForce)> {
        self.parent.deadlines_in_force().into_iter().filter(|(p, _)| self.members.contains(p)).collect()
    }

    /// The generation's links (a subgroup opens none of its own).
    fn linked_peers(&self) -> usize {
        self.parent.linked_peers()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transport that only knows its rank and world (the constructor's checks need no more).
    struct Shape(Rank, u32);

    impl Transport for Shape {
        fn rank(&self) -> Rank {
            self.0
        }
        fn world_size(&self) -> u32 {
            self.1
        }
        fn generation(&self) -> u64 {
            3
        }
        async fn send(&self, _: Rank, _: Tag, _: &[u8]) -> Result<(), TransportError> {
            Ok(())
        }
        async fn recv(&self, _: Rank, _: Tag, _: &mut [u8]) -> Result<(), TransportError> {
            Ok(())
        }
        fn abort(&self, _: AbortReason) {}
        fn is_aborted(&self) -> bool {
            false
        }
    }

    fn refused(members: Vec<Rank>, channel: u32) -> String {
        match Subgroup::new(Arc::new(Shape(2, 4)), members, channel) {
            Err(TransportError::InvalidArgument(msg)) => msg,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn renumbers_and_tags_its_channel() {
        let g = Subgroup::new(Arc::new(Shape(2, 4)), vec![3, 2, 0], 5).expect("valid");
        assert_eq!((g.rank(), g.world_size(), g.generation()), (1, 3, 3));
        assert_eq!(g.global(0).unwrap(), 3);
        assert_eq!(g.global(2).unwrap(), 0);
        assert!(matches!(g.global(3), Err(TransportError::InvalidArgument(_))));
        let t = g.on_channel(Tag::new(SEQ_MASK, 7, 9)).unwrap();
        assert_eq!((channel_of(t.seq), t.seq & SEQ_MASK, t.step, t.signature), (5, SEQ_MASK, 7, 9));
        assert!(matches!(g.on_channel(Tag::new(SEQ_MASK + 1, 0, 0)), Err(TransportError::InvalidArgument(_))));
    }

    #[test]
    fn bad_member_lists_and_channels_are_refused() {
        assert!(refused(vec![0, 2], 0).contains("channel 0"));
        assert!(refused(vec![0, 2], MAX_CHANNEL + 1).contains("out of range"));
        assert!(refused(vec![0, 2, 4], 1).contains("member 4"));
        assert!(refused(vec![2, 0, 2], 1).contains("twice"));
        assert!(refused(vec![0, 1], 1).contains("leaves out this process"));
        assert!(refused(vec![], 1).contains("leaves out"));
        assert!(Subgroup::new(Arc::new(Shape(2, 4)), vec![2], MAX_CHANNEL).is_ok());
    }
}
