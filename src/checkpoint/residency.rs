//! Read-ahead hints, so streaming commands overlap disk reads with computation (releasing pages
//! after use is `Checkpoint::release`).

use super::Checkpoint;

/// Bytes per WILLNEED request: no more than a typical device read-ahead size (4-8 MB), which is
/// the most Linux reads for one request.
#[cfg(unix)]
const PREFETCH_PIECE: usize = 4 << 20;

impl Checkpoint {
    /// Ask the OS to start reading tensor `name` into the page cache without waiting
    /// (`madvise(MADV_WILLNEED)` on its byte range). Commands that stream tensors call it one
    /// tensor or more ahead. It is only a hint: unknown names and refusals are ignored.
    pub fn prefetch(&self, name: &str) {
        #[cfg(unix)]
        if let Some((shard, begin, len)) = self.byte_range(name) {
            // Linux reads at most the device's read-ahead size (a few MB) per WILLNEED call, so a
            // large tensor is asked for in pieces of that order.
            for start in (begin..begin + len).step_by(PREFETCH_PIECE) {
                let piece = PREFETCH_PIECE.min(begin + len - start);
                let _ = (shard.mmap).advise_range(memmap2::Advice::WillNeed, start, piece);
            }
        }
        #[cfg(not(unix))]
        let _ = name;
    }

    #[cfg(unix)]
    fn byte_range(&self, name: &str) -> Option<(&super::Shard, usize, usize)> {
        let &(s, t) = self.index.get(name)?;
        let shard = &self.shards[s];
        let info = &shard.header.tensors[t];
        Some((
            shard,
            shard.header.data_start + info.begin,
            info.end - info.begin,
        ))
    }
}
