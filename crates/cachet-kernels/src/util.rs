//! Small shared pieces at the bottom of the crate: a pointer that pool tasks may share, and a
//! cache-line-aligned byte block.

#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
// SAFETY: used only to hand disjoint output regions to pool tasks.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// 64 bytes aligned to a cache line (packed weights, tile buffers).
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct A64(pub(crate) [u8; 64]);
