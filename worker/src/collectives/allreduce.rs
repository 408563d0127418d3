//! Allreduce: the `Communicator` methods, which choose among the schedules (ring, recursive
//! doubling, BCube, hierarchical; see [`Algorithm`]) and run the chosen one.

use super::{bcube, hierarchical, recursive_doubling, ring};
use crate::algo::Algorithm;
use crate::comm::{Call, CallKind, Communicator};
use crate::dtype::{as_bytes, as_bytes_mut, from_bytes_mut, DType, Element};
use crate::error::CommError;
use crate::reduce::ReduceOp;
use cohort_transports::Transport;
use half::{bf16, f16};

impl<T: Transport> Communicator<T> {
    /// Allreduce `data` in place with the configured algorithm: afterwards every rank holds
    /// the element-wise reduction of all ranks' `data`, with identical bytes on every rank.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future mid-flight aborts the transport and poisons the
    /// communicator (use the [`Revoker`](crate::Revoker) or `op_timeout` to stop an operation on purpose).
    pub async fn allreduce<E: Element>(&mut self, data: &mut [E], op: ReduceOp) -> Result<(), CommError> {
        let algo = self.config().algorithm;
        self.allreduce_with(data, op, algo).await
    }

    /// Allreduce with an explicit algorithm (`Auto` resolves by message size, see
    /// [`Algorithm::resolve`]). All ranks must pass the same algorithm.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allreduce_with<E: Element>(
        &mut self,
        data: &mut [E],
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<(), CommError> {
        let bytes = std::mem::size_of_val(data);
        let algo = algo.resolve_on(bytes, self.layout());
        let call = Call {
            dtype: Some(E::DTYPE),
            op: Some(op),
            count: data.len() as u64,
            algo: Some(algo),
            extra: if algo == Algorithm::Hierarchical { self.layout().fingerprint() } else { 0 },
            ..Call::new(CallKind::ALLREDUCE)
        };
        let (len, n) = (data.len(), self.size() as usize);
        let dims =
            if algo == Algorithm::Bcube { bcube::factorize(n as u32, self.config().bcube_base) } else { Vec::new() };
        let hosts = self.hosts.clone();
        self.run(call, std::mem::size_of::<E>(), bytes, Ok(()), true, async |ctx, scratch| match algo {
            Algorithm::Ring | Algorithm::Auto => {
                let s = scratch.get::<E>(ring::allreduce_scratch(ctx.seg, len, n));
                ring::allreduce(&ctx, data, op, s).await
            }
            Algorithm::RecursiveDoubling => {
                let s = scratch.get::<E>(recursive_doubling::allreduce_scratch(ctx.seg, len));
                recursive_doubling::allreduce(&ctx, data, op, s).await
            }
            Algorithm::Bcube => {
                let s = scratch.get::<E>(bcube::allreduce_scratch(ctx.seg, len, &dims));
                bcube::allreduce(&ctx, data, op, &dims, s).await
            }
            Algorithm::Hierarchical => {
                let s = scratch.get::<E>(hierarchical::allreduce_scratch(ctx.seg, len));
                hierarchical::allreduce(&ctx, data, op, &hosts, s).await
            }
        })
        .await
    }

    /// Allreduce over raw bytes holding elements of `dtype` (native byte order): the untyped
    /// entry for the CLI and benchmarks. A buffer that is not aligned for `dtype` is reduced
    /// through an aligned copy.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allreduce_bytes(&mut self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CommError> {
        match dtype {
            DType::F32 => self.allreduce_bytes_as::<f32>(data, op).await,
            DType::F64 => self.allreduce_bytes_as::<f64>(data, op).await,
            DType::F16 => self.allreduce_bytes_as::<f16>(data, op).await,
            DType::BF16 => self.allreduce_bytes_as::<bf16>(data, op).await,
            DType::I32 => self.allreduce_bytes_as::<i32>(data, op).await,
            DType::I64 => self.allreduce_bytes_as::<i64>(data, op).await,
            DType::U8 => self.allreduce_bytes_as::<u8>(data, op).await,
        }
    }

    async fn allreduce_bytes_as<E: Element>(&mut self, data: &mut [u8], op: ReduceOp) -> Result<(), CommError> {
        let size = std::mem::size_of::<E>();
        if data.len() % size != 0 {
            if let Some(e) = self.poisoned() {
                return Err(e.clone());
            }
            let msg = format!("allreduce_bytes: {} bytes are not a whole number of {} elements", data.len(), E::DTYPE);
            return Err(self.poison(CommError::InvalidArgument(msg)));
        }
        match from_bytes_mut::<E>(data) {
            Some(view) => self.allreduce(view, op).await,
            None => {
                let mut aligned = vec![E::default(); data.len() / size];
                as_bytes_mut(&mut aligned).copy_from_slice(data);
                self.allreduce(&mut aligned, op).await?;
                data.copy_from_slice(as_bytes(&aligned));
                Ok(())
            }
        }
    }
}
