//! Read-ahead hints, so streaming commands overlap disk reads with computation (releasing pages
//! after use is `Checkpoint::release`).

use super::Checkpoint;

impl Checkpoint {
    /// Ask the OS to start reading tensor `name` into the page cache without waiting
    /// (`madvise(MADV_WILLNEED)` on its byte range). Commands that stream tensors call it one
    /// tensor ahead. It is only a hint: unknown names and refusals are ignored.
    pub fn prefetch(&self, name: &str) {
        #[cfg(unix)]
        if let Some((shard, begin, len)) = self.byte_range(name) {
            let _ = shard
                .mmap
                .advise_range(memmap2::Advice::WillNeed, begin, len);
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
