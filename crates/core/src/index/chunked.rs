//! A vector in fixed-size chunks, for the index's large stores (nodes, their canonical engine
//! hashes, holder sets): growing never copies what it holds nor allocates twice its length. A
//! doubling `Vec` of hundreds of thousands of entries copies megabytes, and faults them in anew,
//! under the write lock, and half of it may stand empty.

use super::holders::ALLOCATION_OVERHEAD;

/// Entries in chunks of `1 << BITS`, addressed like a vector.
#[derive(Debug)]
pub(super) struct Chunked<T, const BITS: u32> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T, const BITS: u32> Default for Chunked<T, BITS> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T, const BITS: u32> Chunked<T, BITS> {
    const CHUNK: usize = 1 << BITS;

    /// Appends `value`; returns its index.
    pub(super) fn push(&mut self, value: T) -> usize {
        match self.chunks.last_mut() {
            Some(chunk) if chunk.len() < Self::CHUNK => chunk.push(value),
            _ => {
                let mut chunk = Vec::with_capacity(Self::CHUNK);
                chunk.push(value);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
        self.len - 1
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        self.chunks.iter().flatten()
    }

    /// Bytes of the chunks at their capacity, with an allocator overhead each.
    pub(super) fn memory_bytes(&self) -> usize {
        self.chunks.len() * (Self::CHUNK * std::mem::size_of::<T>() + ALLOCATION_OVERHEAD)
            + self.chunks.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

impl<T, const BITS: u32> std::ops::Index<usize> for Chunked<T, BITS> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        &self.chunks[i >> BITS][i & (Self::CHUNK - 1)]
    }
}

impl<T, const BITS: u32> std::ops::IndexMut<usize> for Chunked<T, BITS> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i >> BITS][i & (Self::CHUNK - 1)]
    }
}
