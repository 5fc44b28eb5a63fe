//! Page-residency hints, so streaming commands overlap disk reads with computation and keep
//! their resident memory at the tensors in use, whatever the model size.

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

    /// Drop tensor `name`'s pages from this process's resident set once it is no longer needed
    /// (`madvise(MADV_DONTNEED)`). The pages stay in the OS page cache, and a later read faults
    /// them back in unchanged, because the mapping is read-only and shared with the file.
    pub fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Some((shard, begin, len)) = self.byte_range(name) {
            // SAFETY: memmap2's `Mmap::map` maps PROT_READ and MAP_SHARED, so no page in the
            // range holds private data: discarding pages cannot change what any reader sees,
            // and the next access reads the same bytes back from the page cache or the file.
            let _ = unsafe {
                shard
                    .mmap
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, begin, len)
            };
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
