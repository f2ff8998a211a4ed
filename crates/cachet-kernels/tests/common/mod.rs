//! Shared by the kernels' test binaries.

use std::sync::Mutex;

use cachet_kernels::isa::{self, Isa};

/// The ISA override is process-global: serialise the tests that use it.
static ISA_LOCK: Mutex<()> = Mutex::new(());

/// Runs `f` once at every instruction-set level this CPU supports, with that level forced.
pub fn for_each_isa(mut f: impl FnMut(Isa)) {
    let _g = ISA_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    for level in Isa::supported() {
        isa::set_override(Some(level));
        assert_eq!(isa::active(), level);
        f(level);
    }
    isa::set_override(None);
}
