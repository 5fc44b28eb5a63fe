//! The KV cache of a decode (`docs/commands/generate.md`, "The KV cache"): per layer, the keys
//! and values of every position so far, as transformers' `DynamicCache` holds them (keys after
//! their bias, k-norm, any key edit and RoPE), laid out `[kv_heads, capacity, head_dim]` on the
//! backend. The capacity is fixed when the decode starts (the prompt and every token it may
//! add), so a step writes its rows in place and nothing is reallocated.
//!
//! Sliding-window layers keep every position too and attend within their window by the mask:
//! transformers' sliding cache layers drop what the window no longer sees, which changes no
//! attention.

use super::backend::{Backend, CachedShape};
use super::model::DecoderSpec;
use crate::bail;
use crate::error::Result;

/// One layer's cached keys and values.
struct LayerKv<T> {
    keys: T,
    values: T,
}

/// Every layer's keys and values of the positions `0..len`.
pub struct KvCache<T> {
    layers: Vec<LayerKv<T>>,
    len: usize,
    capacity: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl<T> KvCache<T> {
    /// An empty cache with room for `capacity` positions of every layer of `spec`.
    pub fn new<B: Backend<Tensor = T>>(
        backend: &B,
        spec: &DecoderSpec,
        capacity: usize,
    ) -> Result<KvCache<T>> {
        let width = spec.num_kv_heads * spec.head_dim;
        let layers = (0..spec.num_layers())
            .map(|_| {
                Ok(LayerKv {
                    keys: backend.zeros(capacity, width)?,
                    values: backend.zeros(capacity, width)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(KvCache {
            layers,
            len: 0,
            capacity,
            num_kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
        })
    }

    /// The bytes a cache of `capacity` positions holds for `spec`.
    pub fn bytes(spec: &DecoderSpec, capacity: usize) -> f64 {
        2.0 * 4.0
            * spec.num_layers() as f64
            * capacity as f64
            * (spec.num_kv_heads * spec.head_dim) as f64
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the cache has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The attention shape of `queries` new positions after the cached ones.
    pub fn shape(&self, num_heads: usize, queries: usize, window: Option<usize>) -> CachedShape {
        CachedShape {
            num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            capacity: self.capacity,
            queries,
            offset: self.len,
            window,
            scale: (self.head_dim as f32).powf(-0.5),
        }
    }

    /// Write `layer`'s keys and values of `rows` new positions (`[rows, kv_heads · head_dim]`)
    /// after the cached ones; [`KvCache::advance`] counts them once every layer has.
    pub fn write<B: Backend<Tensor = T>>(
        &mut self,
        backend: &B,
        layer: usize,
        keys: &T,
        values: &T,
        rows: usize,
    ) -> Result<()> {
        if self.len + rows > self.capacity {
            bail!(
                "the KV cache holds {} positions; {} more do not fit",
                self.capacity,
                rows
            );
        }
        let shape = self.shape(self.num_kv_heads, rows, None);
        let kv = &mut self.layers[layer];
        backend.cache_write(&mut kv.keys, keys, &shape, self.len)?;
        backend.cache_write(&mut kv.values, values, &shape, self.len)
    }

    /// `layer`'s cached keys and values.
    pub fn layer(&self, layer: usize) -> (&T, &T) {
        let kv = &self.layers[layer];
        (&kv.keys, &kv.values)
    }

    /// Count `rows` positions every layer has written.
    pub fn advance(&mut self, rows: usize) {
        self.len += rows;
    }
}
