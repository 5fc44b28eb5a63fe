//! Reading ahead of a streaming pass: a background thread reads and decodes the tensors the pass
//! will ask for next while it computes (docs/commands/score.md#memory-and-reading-ahead).
//!
//! The pass declares the tensors it will ask for, in order, in groups (one group per block of
//! one layer of one model). The thread walks that list, decoding each tensor to f32 with the
//! same function as [`Checkpoint::read_tensor`] (so the values are the same bits), as long as the
//! f32 bytes decoded and not yet taken stay within a budget. A tensor the thread has not started
//! when the pass asks for it is decoded by the pass itself, as without reading ahead; when the
//! pass first asks for a tensor of a later group, what is left of earlier groups is dropped.
//! The list only decides what is read early: the values a pass gets never depend on it.
//!
//! A backend that decodes on its device asks for stored bytes instead
//! ([`Prefetch::take_resident`]): from then on the thread only brings each tensor's pages into
//! memory, and the budget counts stored bytes.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use memmap2::Mmap;
use safetensors::Dtype;

use super::Checkpoint;
use crate::dtype;

/// One tensor the thread may read: where its bytes are, independent of the [`Checkpoint`]'s
/// lifetime (the map is shared).
struct Source {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
    dtype: Dtype,
    what: String,
    group: usize,
}

impl Source {
    fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    fn cost(&self, mode: Mode) -> usize {
        match mode {
            Mode::Decode => self.len / dtype::byte_size(self.dtype).max(1) * 4,
            Mode::Resident => self.len,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Decode to f32 (backends that compute on the host).
    Decode,
    /// Only bring the stored bytes into memory (backends that decode on their device).
    Resident,
}

enum Slot {
    Waiting,
    /// Being read by the thread; `cost` bytes of the budget.
    Reading {
        cost: usize,
    },
    /// Read: the f32 values (empty in [`Mode::Resident`]).
    Ready {
        values: Vec<f32>,
        cost: usize,
    },
    /// Taken, dropped, or left to the pass.
    Gone,
}

struct State {
    slots: Vec<Slot>,
    /// The next slot the thread considers.
    next: usize,
    /// Bytes read ahead and not yet taken (what the budget bounds).
    ahead: usize,
    budget: usize,
    mode: Mode,
    /// The latest group the pass asked for, and the first slot not yet dropped for being older.
    group: usize,
    dropped_to: usize,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Tensors read ahead for a streaming pass; dropping it stops the thread (after the tensor it is
/// reading) and frees what was not taken.
pub struct Prefetch {
    shared: Arc<Shared>,
    /// (source, stored name) -> slot.
    index: HashMap<(usize, String), usize>,
    groups: Vec<usize>,
    thread: Option<JoinHandle<()>>,
    /// Every request, in order, for tests that check the plan against the pass.
    #[cfg(test)]
    requests: Mutex<Vec<Request>>,
}

/// A tensor asked for: (source, stored name).
#[cfg(test)]
pub type Request = (usize, String);

/// One tensor a pass will ask for: of which source (a model of the pass) and in which group.
pub struct Planned<'c> {
    pub source: usize,
    pub ckpt: &'c Checkpoint,
    /// The name as stored.
    pub name: String,
    /// Groups never decrease along the plan.
    pub group: usize,
}

impl Prefetch {
    /// Start reading `plan` ahead with at most `budget` bytes read and not yet taken. Tensors
    /// that are not stored are left out (the pass reports them when it asks).
    pub fn start(plan: Vec<Planned>, budget: usize) -> Prefetch {
        let mut sources = Vec::with_capacity(plan.len());
        let mut index = HashMap::new();
        let mut groups = Vec::with_capacity(plan.len());
        for p in plan {
            let Some(source) = p.ckpt.source(&p.name, p.group) else {
                continue;
            };
            if index.insert((p.source, p.name), sources.len()).is_some() {
                // Asked for twice in one plan: the second request is served by the pass.
                continue;
            }
            groups.push(p.group);
            sources.push(source);
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                slots: sources.iter().map(|_| Slot::Waiting).collect(),
                next: 0,
                ahead: 0,
                budget,
                mode: Mode::Decode,
                group: 0,
                dropped_to: 0,
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let thread = (!sources.is_empty() && budget > 0)
            .then(|| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name("sinkmerge-prefetch".into())
                    .spawn(move || read_ahead(&shared, &sources))
                    .ok()
            })
            .flatten();
        Prefetch {
            shared,
            index,
            groups,
            thread,
            #[cfg(test)]
            requests: Mutex::new(Vec::new()),
        }
    }

    /// The f32 values of `name` (stored name) of `source` if the thread has read them (waiting
    /// for it when it is reading them now); `None` when the caller must decode them itself.
    pub fn take(&self, source: usize, name: &str) -> Option<Vec<f32>> {
        #[cfg(test)]
        self.record(source, name);
        let i = *self.index.get(&(source, name.to_string()))?;
        match self.wait(self.enter(i), i) {
            // Empty: read in resident mode (or a tensor of no values), which the caller decodes.
            Slot::Ready { values, .. } if !values.is_empty() => Some(values),
            _ => None,
        }
    }

    /// Note that the pass reads `name` of `source` as stored bytes (its backend decodes them):
    /// from here on the thread only brings pages into memory. Returns once the thread is done
    /// with this tensor; the bytes are then read from the map as usual.
    pub fn take_resident(&self, source: usize, name: &str) {
        #[cfg(test)]
        self.record(source, name);
        let Some(&i) = self.index.get(&(source, name.to_string())) else {
            return;
        };
        let mut st = self.enter(i);
        if st.mode == Mode::Decode {
            st.mode = Mode::Resident;
            self.shared.changed.notify_all();
        }
        self.wait(st, i);
    }

    #[cfg(test)]
    fn record(&self, source: usize, name: &str) {
        let mut requests = self.requests.lock().unwrap();
        requests.push((source, name.to_string()));
    }

    /// The requests so far, and the plan (slot order), for tests.
    #[cfg(test)]
    pub fn requests_and_plan(&self) -> (Vec<Request>, Vec<Request>) {
        let mut plan: Vec<_> = self.index.iter().map(|(k, &i)| (i, k.clone())).collect();
        plan.sort();
        let plan = plan.into_iter().map(|(_, k)| k).collect();
        (self.requests.lock().unwrap().clone(), plan)
    }

    /// Lock the state for a request of slot `i`, first dropping whatever earlier groups left.
    fn enter(&self, i: usize) -> MutexGuard<'_, State> {
        let mut st = self.shared.lock();
        let group = self.groups[i];
        if group > st.group {
            st.group = group;
            let mut j = st.dropped_to;
            while j < self.groups.len() && self.groups[j] < group {
                match std::mem::replace(&mut st.slots[j], Slot::Gone) {
                    Slot::Ready { cost, .. } => st.ahead -= cost,
                    // The thread drops it when it finishes.
                    reading @ Slot::Reading { .. } => st.slots[j] = reading,
                    Slot::Waiting | Slot::Gone => {}
                }
                j += 1;
            }
            st.dropped_to = j;
            self.shared.changed.notify_all();
        }
        st
    }

    /// Wait while slot `i` is being read, then take it (a slot not started is left to the
    /// caller).
    fn wait(&self, mut st: MutexGuard<'_, State>, i: usize) -> Slot {
        while matches!(st.slots[i], Slot::Reading { .. }) {
            st = (self.shared.changed.wait(st)).unwrap_or_else(|e| e.into_inner());
        }
        let slot = std::mem::replace(&mut st.slots[i], Slot::Gone);
        if let Slot::Ready { cost, .. } = slot {
            st.ahead -= cost;
        }
        self.shared.changed.notify_all();
        slot
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread: read each planned tensor in order while the budget allows.
fn read_ahead(shared: &Shared, sources: &[Source]) {
    // Decoding runs on a pool of its own, so its page faults never hold up a worker of the
    // pass's pool; the values do not depend on the pool (decoding is elementwise).
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().ok();
    loop {
        let (i, mode) = {
            let mut st = shared.lock();
            loop {
                if st.stop {
                    return;
                }
                while st.next < sources.len()
                    && (!matches!(st.slots[st.next], Slot::Waiting)
                        || sources[st.next].group < st.group)
                {
                    st.next += 1;
                }
                let Some(source) = sources.get(st.next) else {
                    return;
                };
                if st.ahead + source.cost(st.mode) <= st.budget {
                    break;
                }
                st = shared.changed.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            let (i, mode) = (st.next, st.mode);
            let cost = sources[i].cost(mode);
            st.slots[i] = Slot::Reading { cost };
            st.ahead += cost;
            st.next += 1;
            (i, mode)
        };
        let source = &sources[i];
        let read = read(source, mode, pool.as_ref());
        let mut st = shared.lock();
        let cost = match st.slots[i] {
            Slot::Reading { cost } => cost,
            _ => 0,
        };
        st.slots[i] = match read {
            Some(values) if source.group >= st.group => Slot::Ready { values, cost },
            // Dropped while read (the pass has moved on), or not decodable (the pass decodes
            // it again and reports the error).
            _ => {
                st.ahead -= cost;
                Slot::Gone
            }
        };
        shared.changed.notify_all();
    }
}

/// Read one tensor: its f32 values, or (resident mode) an empty vector once its pages are in.
fn read(source: &Source, mode: Mode, pool: Option<&rayon::ThreadPool>) -> Option<Vec<f32>> {
    will_need(source);
    let bytes = source.bytes();
    match mode {
        Mode::Decode => {
            let decode = || dtype::decode(source.dtype, bytes, &source.what).ok();
            let values = match pool {
                Some(pool) => pool.install(decode),
                None => decode(),
            };
            // As `Model::tensor` does once a tensor is decoded: the pages leave the resident
            // set (they stay in the page cache).
            dont_need(source);
            values
        }
        Mode::Resident => {
            // Touch one byte per page, so each page is in memory when the pass reads it.
            let page = 4096;
            let mut sum = 0u8;
            for b in bytes.iter().step_by(page) {
                sum = sum.wrapping_add(*b);
            }
            std::hint::black_box(sum);
            Some(Vec::new())
        }
    }
}

/// Bytes per WILLNEED request (see `residency.rs`).
const PIECE: usize = 4 << 20;

fn will_need(source: &Source) {
    #[cfg(unix)]
    for start in (source.start..source.start + source.len).step_by(PIECE) {
        let piece = PIECE.min(source.start + source.len - start);
        let _ = source
            .map
            .advise_range(memmap2::Advice::WillNeed, start, piece);
    }
    #[cfg(not(unix))]
    let _ = source;
}

fn dont_need(source: &Source) {
    // SAFETY: the map is read-only and file-backed, so MADV_DONTNEED discards nothing (see
    // `Shard::release`).
    #[cfg(unix)]
    let _ = unsafe {
        source.map.unchecked_advise_range(
            memmap2::UncheckedAdvice::DontNeed,
            source.start,
            source.len,
        )
    };
    #[cfg(not(unix))]
    let _ = source;
}

impl Checkpoint {
    /// Where tensor `name` lies, for the read-ahead thread.
    fn source(&self, name: &str, group: usize) -> Option<Source> {
        let &(s, t) = self.index.get(name)?;
        let shard = &self.shards[s];
        let info = &shard.header.tensors[t];
        Some(Source {
            map: Arc::clone(&shard.mmap),
            start: shard.header.data_start + info.begin,
            len: info.end - info.begin,
            dtype: info.dtype,
            what: self.describe(name),
            group,
        })
    }
}

/// `--max-memory`: the most bytes of f32 weights a streaming pass holds at once, the layer it
/// computes and those read ahead together (0: no limit given).
static MAX_MEMORY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Set `--max-memory` for the passes this process runs.
pub fn set_max_memory(bytes: Option<u64>) {
    MAX_MEMORY.store(bytes.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}

/// The read-ahead budget of a pass whose largest layer holds `layer` bytes of f32 weights: one
/// more layer, so that two layers are resident at most (the one computing and the next); under
/// `--max-memory M`, what M leaves beside the computing layer, `min(layer, M - layer)`, and
/// nothing when M does not exceed one layer.
pub fn budget(layer: usize) -> usize {
    match MAX_MEMORY.load(std::sync::atomic::Ordering::Relaxed) {
        0 => layer,
        max => layer.min(
            usize::try_from(max)
                .unwrap_or(usize::MAX)
                .saturating_sub(layer),
        ),
    }
}
