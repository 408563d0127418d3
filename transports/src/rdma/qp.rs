//! Reliable-connected queue pairs: the state machine (pure) and the verbs object.
//!
//! A QP is created in `RESET` and brought up `RESET -> INIT -> RTR -> RTS`; any state may go
//! to `ERR` (which flushes every outstanding work request: that is how abort works) and
//! `ERR -> RESET`. [`QpStateMachine`] enforces exactly these transitions and names the
//! attribute mask each one needs, so an illegal sequence is an error before any verbs call.

use super::address::{Mtu, RdmaAddress};
use super::cq::CompletionQueue;
use super::device::Device;
use crate::TransportError;
use rdma_sys as ffi;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// States of a queue pair the transport uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Just created; no work can be posted.
    Reset,
    /// Receives may be posted; nothing moves.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed or aborted; outstanding work is flushed with errors.
    Err,
}

impl QpState {
    /// The `ibv_qp_state` value.
    pub fn to_verbs(self) -> u32 {
        use ffi::ibv_qp_state::*;
        match self {
            Self::Reset => IBV_QPS_RESET,
            Self::Init => IBV_QPS_INIT,
            Self::Rtr => IBV_QPS_RTR,
            Self::Rts => IBV_QPS_RTS,
            Self::Err => IBV_QPS_ERR,
        }
    }
}

/// An illegal queue-pair transition.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("illegal queue pair transition {from:?} -> {to:?}")]
pub struct QpTransitionError {
    /// Current state.
    pub from: QpState,
    /// Requested state.
    pub to: QpState,
}

/// Tracks a queue pair's state and allows only the legal transitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpStateMachine {
    state: QpState,
}

impl Default for QpStateMachine {
    fn default() -> Self {
        Self::new()
    }
}

impl QpStateMachine {
    /// A machine in `RESET`.
    pub fn new() -> Self {
        Self { state: QpState::Reset }
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// Whether `from -> to` is legal.
    pub fn is_legal(from: QpState, to: QpState) -> bool {
        use QpState::*;
        matches!((from, to), (Reset, Init) | (Init, Rtr) | (Rtr, Rts) | (_, Err) | (Err, Reset))
    }

    /// Checks `self.state -> to` without changing anything.
    pub fn check(&self, to: QpState) -> Result<(), QpTransitionError> {
        if Self::is_legal(self.state, to) {
            Ok(())
        } else {
            Err(QpTransitionError { from: self.state, to })
        }
    }

    /// Moves to `to` if legal.
    pub fn advance(&mut self, to: QpState) -> Result<(), QpTransitionError> {
        self.check(to)?;
        self.state = to;
        Ok(())
    }

    /// The `ibv_qp_attr_mask` bits the transition into `to` sets.
    pub fn mask_for(to: QpState) -> u32 {
        use ffi::ibv_qp_attr_mask as m;
        let bits = match to {
            QpState::Init => m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
            QpState::Rtr => {
                m::IBV_QP_STATE
                    | m::IBV_QP_AV
                    | m::IBV_QP_PATH_MTU
                    | m::IBV_QP_DEST_QPN
                    | m::IBV_QP_RQ_PSN
                    | m::IBV_QP_MAX_DEST_RD_ATOMIC
                    | m::IBV_QP_MIN_RNR_TIMER
            }
            QpState::Rts => {
                m::IBV_QP_STATE
                    | m::IBV_QP_TIMEOUT
                    | m::IBV_QP_RETRY_CNT
                    | m::IBV_QP_RNR_RETRY
                    | m::IBV_QP_SQ_PSN
                    | m::IBV_QP_MAX_QP_RD_ATOMIC
            }
            QpState::Err | QpState::Reset => m::IBV_QP_STATE,
        };
        bits.0
    }
}

/// Reliability settings of the RC connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpTiming {
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout per try (14 ≈ 67 ms).
    pub timeout: u8,
    /// Transport retries before a send fails with `RETRY_EXC_ERR` (at most 7).
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite; the transport keeps receives posted so RNR never lasts).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer code (12 = 0.64 ms).
    pub min_rnr_timer: u8,
}

impl Default for QpTiming {
    fn default() -> Self {
        Self { timeout: 14, retry_cnt: 7, rnr_retry: 7, min_rnr_timer: 12 }
    }
}

/// An RC queue pair.
pub struct QueuePair {
    qp: NonNull<ffi::ibv_qp>,
    sm: Mutex<QpStateMachine>,
    device: Arc<Device>,
    // Keeps the CQ alive while the QP exists (destroyed first).
    _cq: Arc<CompletionQueue>,
}

// SAFETY: verbs QP calls (post_send, post_recv, modify_qp) are thread-safe in libibverbs;
// the state machine is behind a mutex.
unsafe impl Send for QueuePair {}
// SAFETY: see Send.
unsafe impl Sync for QueuePair {}

fn verr(what: &str, rc: i32) -> TransportError {
    let code = if rc > 0 { rc } else { std::io::Error::last_os_error().raw_os_error().unwrap_or(0) };
    TransportError::Io(format!("{what} failed: {}", std::io::Error::from_raw_os_error(code)))
}

impl QueuePair {
    /// Creates an RC QP on `cq` (send and receive) with room for `send_wr` and `recv_wr`
    /// work requests and moves it to `INIT` with remote-write access.
    pub fn new(
        device: &Arc<Device>,
        cq: &Arc<CompletionQueue>,
        send_wr: u32,
        recv_wr: u32,
    ) -> Result<Self, TransportError> {
        let max = u32::try_from(device.max_qp_wr().max(1)).unwrap_or(1);
        // SAFETY: plain old data; zero is valid.
        let mut init: ffi::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw();
        init.recv_cq = cq.raw();
        init.qp_type = ffi::ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = send_wr.clamp(1, max);
        init.cap.max_recv_wr = recv_wr.clamp(1, max);
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: valid PD and init attributes referring to a live CQ.
        let qp = NonNull::new(unsafe { ffi::ibv_create_qp(device.pd(), &mut init) })
            .ok_or_else(|| verr("ibv_create_qp", 0))?;
        let this = Self { qp, sm: Mutex::new(QpStateMachine::new()), device: device.clone(), _cq: cq.clone() };
        // SAFETY: plain old data.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.pkey_index = 0;
        attr.port_num = device.port();
        attr.qp_access_flags =
            ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 | ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        this.modify(QpState::Init, &mut attr)?;
        Ok(this)
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: valid QP; qp_num is immutable after creation.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// The current state as tracked.
    pub fn state(&self) -> QpState {
        self.sm.lock().unwrap_or_else(|e| e.into_inner()).state()
    }

    fn modify(&self, to: QpState, attr: &mut ffi::ibv_qp_attr) -> Result<(), TransportError> {
        let mut sm = self.sm.lock().unwrap_or_else(|e| e.into_inner());
        sm.check(to).map_err(|e| TransportError::Io(e.to_string()))?;
        attr.qp_state = to.to_verbs();
        // SAFETY: valid QP and attributes; the mask names only fields we set.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp.as_ptr(), attr, QpStateMachine::mask_for(to) as i32) };
        if rc != 0 {
            return Err(verr(&format!("ibv_modify_qp to {to:?}"), rc));
        }
        // Checked above.
        let _ = sm.advance(to);
        Ok(())
    }

    /// `INIT -> RTR` towards `remote`, at the smaller of both MTUs; `global` adds a global
    /// route header (needed on RoCE and across IB subnets).
    pub fn to_rtr(&self, remote: &RdmaAddress, timing: QpTiming) -> Result<(), TransportError> {
        let mtu: Mtu = remote.mtu.min(self.device.mtu());
        // SAFETY: plain old data.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.path_mtu = mtu.to_verbs();
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = timing.min_rnr_timer;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = self.device.port();
        if self.device.is_ethernet() || remote.lid == 0 {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = self.device.gid_index();
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = 0;
            attr.ah_attr.grh.flow_label = 0;
        }
        self.modify(QpState::Rtr, &mut attr)
    }

    /// `RTR -> RTS` with our initial send PSN.
    pub fn to_rts(&self, psn: u32, timing: QpTiming) -> Result<(), TransportError> {
        // SAFETY: plain old data.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.timeout = timing.timeout;
        attr.retry_cnt = timing.retry_cnt.min(7);
        attr.rnr_retry = timing.rnr_retry.min(7);
        attr.sq_psn = psn;
        attr.max_rd_atomic = 1;
        self.modify(QpState::Rts, &mut attr)
    }

    /// Moves the QP to `ERR`: outstanding work requests complete with `WR_FLUSH_ERR` and the
    /// peer's next operation fails. Local, never waits; idempotent.
    pub fn to_error(&self) -> Result<(), TransportError> {
        if self.state() == QpState::Err {
            return Ok(());
        }
        // SAFETY: plain old data.
        let mut attr: ffi::ibv_qp_attr = unsafe { std::mem::zeroed() };
        self.modify(QpState::Err, &mut attr)
    }

    /// Posts a receive without buffers (write-with-immediate and zero-length sends need one
    /// posted receive each).
    pub fn post_recv(&self, wr_id: u64) -> Result<(), TransportError> {
        // SAFETY: plain old data.
        let mut wr: ffi::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.num_sge = 0;
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: valid QP; the WR has no scatter list and lives across the call.
        let rc = unsafe { ffi::ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(verr("ibv_post_recv", rc));
        }
        Ok(())
    }

    /// Posts a signaled RDMA write with immediate of `len` bytes from local `addr`/`lkey` to
    /// `remote_addr`/`rkey`.
    #[allow(clippy::too_many_arguments)]
    pub fn post_write_imm(
        &self,
        wr_id: u64,
        addr: u64,
        len: u32,
        lkey: u32,
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    ) -> Result<(), TransportError> {
        let mut sge = ffi::ibv_sge { addr, length: len, lkey };
        // SAFETY: plain old data.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        wr.wr.rdma = ffi::rdma_t { remote_addr, rkey };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: valid QP; `sge` and `wr` live across the call; the local range is inside a
        // registered buffer the caller owns until the completion.
        let rc = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(verr("ibv_post_send (RDMA write with immediate)", rc));
        }
        Ok(())
    }

    /// Posts a signaled zero-length send with immediate (a credit return).
    pub fn post_send_imm(&self, wr_id: u64, imm: u32) -> Result<(), TransportError> {
        // SAFETY: plain old data.
        let mut wr: ffi::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.num_sge = 0;
        wr.opcode = ffi::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
        wr.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: valid QP; no scatter list.
        let rc = unsafe { ffi::ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(verr("ibv_post_send (send with immediate)", rc));
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: valid QP destroyed once; its CQ outlives it (we hold an Arc).
        unsafe { ffi::ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpState::*;

    #[test]
    fn bring_up_sequence_is_legal() {
        let mut sm = QpStateMachine::new();
        assert_eq!(sm.state(), Reset);
        for s in [Init, Rtr, Rts, Err, Reset, Init] {
            sm.advance(s).unwrap();
            assert_eq!(sm.state(), s);
        }
    }

    #[test]
    fn illegal_transitions_are_errors_and_change_nothing() {
        let all = [Reset, Init, Rtr, Rts, Err];
        let legal = [(Reset, Init), (Init, Rtr), (Rtr, Rts), (Err, Reset)];
        for from in all {
            for to in all {
                let expect = to == Err || legal.contains(&(from, to));
                assert_eq!(QpStateMachine::is_legal(from, to), expect, "{from:?} -> {to:?}");
            }
        }
        let mut sm = QpStateMachine::new();
        assert_eq!(sm.advance(Rtr), Result::Err(QpTransitionError { from: Reset, to: Rtr }));
        assert_eq!(sm.state(), Reset);
        sm.advance(Init).unwrap();
        assert!(sm.advance(Rts).is_err());
        assert!(sm.advance(Init).is_err());
        sm.advance(Rtr).unwrap();
        assert!(sm.advance(Init).is_err());
        sm.advance(Rts).unwrap();
        assert!(sm.advance(Rtr).is_err());
        assert_eq!(sm.state(), Rts);
        sm.advance(Err).unwrap();
        sm.advance(Err).unwrap();
        assert!(sm.advance(Rts).is_err());
    }

    #[test]
    fn masks_carry_what_each_transition_needs() {
        use ffi::ibv_qp_attr_mask as m;
        let rtr = QpStateMachine::mask_for(Rtr);
        for need in [m::IBV_QP_STATE, m::IBV_QP_AV, m::IBV_QP_PATH_MTU, m::IBV_QP_DEST_QPN, m::IBV_QP_RQ_PSN] {
            assert_ne!(rtr & need.0, 0);
        }
        let rts = QpStateMachine::mask_for(Rts);
        for need in [m::IBV_QP_SQ_PSN, m::IBV_QP_TIMEOUT, m::IBV_QP_RETRY_CNT, m::IBV_QP_RNR_RETRY] {
            assert_ne!(rts & need.0, 0);
        }
        assert_eq!(rts & m::IBV_QP_AV.0, 0);
        assert_ne!(QpStateMachine::mask_for(Init) & m::IBV_QP_ACCESS_FLAGS.0, 0);
        assert_eq!(QpStateMachine::mask_for(Err), m::IBV_QP_STATE.0);
    }
}
