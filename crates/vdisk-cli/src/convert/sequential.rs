//! qemu-img convert's own copy loop, one run after another: what a salvaging copy uses, so
//! that its warnings come in qemu-img's order (the parallel copy reads in its own order).

use vdisk::bytes::AlignedBuf;

use super::progress::{buffer, walk, CopyProgress, Kind};
use super::{salvage, write, write_sparse, writing, zero, Plan, Sources, Target};

/// Copies as qemu-img's salvaging copy does: one run after another in its order, so that its
/// warnings come in qemu-img's order too (each sector given up once, in the walk that meets
/// it). Not for a compressed target, which copies cluster by cluster.
pub(super) fn copy(
    source: &Sources,
    target: &Target,
    plan: &Plan,
    progress: Option<&CopyProgress>,
) -> vdisk::Result<()> {
    let (size, compressed) = buffer(target);
    let mut buf = AlignedBuf::zeroed(size as usize);
    walk(source, plan, size, compressed, |pos, n, kind| {
        let zero_written = plan.sparse == 0 && kind == Kind::Zero;
        match kind {
            Kind::Backing => {}
            Kind::Zero if !zero_written => {
                if !plan.zero_init {
                    zero(target, pos, n).map_err(writing(pos))?;
                }
            }
            _ => {
                let data = &mut buf[..n as usize];
                match kind {
                    Kind::Data => salvage::read(source, plan, pos, data)?,
                    _ => data.fill(0),
                }
                let written = match plan.copy_offload {
                    true => write(target, pos, data),
                    false => write_sparse(target, plan, pos, data),
                };
                written.map_err(writing(pos))?;
            }
        }
        if let Some(p) = progress {
            p.copied(pos, pos + n);
        }
        Ok(())
    })
}
