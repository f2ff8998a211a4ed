//! The disk tier: one file per block under `--kv-tier-disk-path`, in the Redis tier's value
//! format ([`crate::format`]: version, namespace, checksum, optional HMAC), bounded by
//! `--kv-tier-disk-bytes` (least recently used first), surviving a restart.
//!
//! **Layout.** `{path}/LOCK` (held with `flock` while a process uses the directory: a second
//! instance is refused at start) and `{path}/blocks/{hash hex}.kv`. A save writes
//! `{hash}.tmp` and renames it, so a crash leaves a `.tmp` (removed at the next start), never a
//! half-written `.kv`.
//!
//! **Index.** In memory: block hash → file length, in recency order. Rebuilt at start from the
//! directory ([`DiskTier::open`]): each file's header is read ([`crate::format::read_header`]),
//! a file whose length or name disagrees with its header is torn (removed), a file of another
//! model, KV layout, block size or format version is left alone and not indexed (counted and
//! logged once). Recency across a restart is the files' modification time: a save sets it and a
//! load refreshes it.
//!
//! **Threads.** [`DiskStore`] is synchronous file I/O. The client ([`crate::TierClient`]) sends
//! saves through a bounded queue (`--kv-tier-save-queue`; a full queue drops the save and counts
//! it) to one writer thread and runs loads on one reader thread; the engine thread only consults
//! the index (a map under a mutex).
//!
//! **Faults.** A write that fails (disk full, I/O error) is dropped and counted
//! (`save_failures`), the file removed; serving goes on. A read that fails, or a file that fails
//! its checks (truncated, changed, foreign, badly signed) is refused for that block (the engine
//! computes it), counted by cause, and dropped from the index (a refused file is removed).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use cachet_core::BlockHash;
use lru::LruCache;

use crate::config::{DiskConfig, Secret};
use crate::format::{decode_value, encode_value, header_len, read_header, LoadError};
use crate::TierError;

/// How long the index rebuild at start may take; files not reached by then are left on disk,
/// unindexed (logged).
pub const REBUILD_LIMIT: Duration = Duration::from_secs(30);

/// A block file's name: 64 hex digits of the hash and `.kv`.
fn file_name(hash: &BlockHash) -> String {
    let mut s = String::with_capacity(67);
    for b in hash.0 {
        s.push_str(&format!("{b:02x}"));
    }
    s.push_str(".kv");
    s
}

/// The hash a block file's name carries (`None`: not a block file).
fn parse_name(name: &str) -> Option<BlockHash> {
    let hex = name.strip_suffix(".kv")?;
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(BlockHash(out))
}

/// The index: hash → value bytes on disk, least recently used first.
pub(crate) struct DiskIndex {
    map: LruCache<BlockHash, u64>,
    /// Bytes of the indexed files plus the write in progress.
    bytes: u64,
    capacity: u64,
    evictions: u64,
}

impl DiskIndex {
    fn new(capacity: u64) -> Self {
        DiskIndex {
            map: LruCache::unbounded(),
            bytes: 0,
            capacity,
            evictions: 0,
        }
    }

    pub(crate) fn contains(&self, h: &BlockHash) -> bool {
        self.map.contains(h)
    }

    /// Makes `h` most recently used; whether it is held.
    pub(crate) fn touch(&mut self, h: &BlockHash) -> bool {
        self.map.get(h).is_some()
    }

    fn remove(&mut self, h: &BlockHash) -> bool {
        match self.map.pop(h) {
            Some(len) => {
                self.bytes -= len;
                true
            }
            None => false,
        }
    }

    /// Reserves `len` bytes for a new file, evicting least recently used blocks (returned: their
    /// files are to be removed). `None` when `len` alone exceeds the capacity.
    fn reserve(&mut self, len: u64) -> Option<Vec<BlockHash>> {
        if len > self.capacity {
            return None;
        }
        let mut gone = Vec::new();
        while self.bytes + len > self.capacity {
            match self.map.pop_lru() {
                Some((h, l)) => {
                    self.bytes -= l;
                    self.evictions += 1;
                    gone.push(h);
                }
                None => break,
            }
        }
        self.bytes += len;
        Some(gone)
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// What the rebuild at start found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RebuildReport {
    /// Block files indexed, and their bytes.
    pub blocks: u64,
    pub bytes: u64,
    /// Files of another model, KV layout, block size or format version: left alone, not indexed.
    pub foreign: u64,
    /// Torn or unreadable files (a crash's leftovers, bad headers, wrong lengths): removed.
    pub removed: u64,
    /// Indexed files evicted because they exceeded the byte budget (a lowered budget).
    pub over_budget: u64,
    /// Files not examined because the rebuild ran out of time.
    pub unscanned: u64,
}

/// Why the disk directory cannot be used; the message is the whole story (one line).
fn unusable(path: &Path, what: &str, e: impl std::fmt::Display) -> TierError {
    TierError::DiskUnusable(format!(
        "--kv-tier-disk-path {}: {what}: {e}",
        path.display()
    ))
}

/// Takes the directory's lock file (and writes this process' id into it), or says who holds it.
fn take_lock(dir: &Path) -> Result<File, TierError> {
    use std::os::fd::AsRawFd;
    let path = dir.join("LOCK");
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| unusable(dir, "cannot open the lock file", e))?;
    // SAFETY: flock on a file descriptor this function owns; no memory is passed.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::WouldBlock {
            return Err(unusable(dir, "cannot lock", e));
        }
        let mut holder = String::new();
        let _ = f.read_to_string(&mut holder);
        let holder = holder.trim();
        let holder = if holder.is_empty() { "?" } else { holder };
        return Err(unusable(
            dir,
            "in use by another cachet process",
            format!("pid {holder} holds its LOCK (two instances cannot share one disk tier)"),
        ));
    }
    let _ = f.set_len(0);
    let _ = writeln!(f, "{}", std::process::id());
    Ok(f)
}

/// What [`DiskStore::write`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskWrite {
    /// Written; `evicted` older blocks' files were removed to make room.
    Stored { evicted: usize, value_bytes: u64 },
    /// The index already holds the block (made most recently used); nothing written.
    Held,
    /// One value is larger than the whole budget; nothing written.
    TooLarge,
}

/// The block files of one directory and their index. Every method is synchronous file I/O: the
/// client calls them from its disk threads ([`crate::TierClient`]), never from the engine's.
pub struct DiskStore {
    dir: PathBuf,
    blocks_dir: PathBuf,
    index: Mutex<DiskIndex>,
    ns: crate::TierNamespace,
    secret: Option<Secret>,
    /// Test hook: every write fails as a full disk would.
    fail_writes: AtomicBool,
    /// Held for the store's life: the `flock` on `{path}/LOCK`.
    _lock: File,
}

impl DiskStore {
    /// Creates (or reopens) the directory, takes its lock, checks that it is writable and
    /// rebuilds the index from the files there (within [`REBUILD_LIMIT`]).
    pub fn open(
        cfg: &DiskConfig,
        ns: &crate::TierNamespace,
    ) -> Result<(DiskStore, RebuildReport), TierError> {
        let dir = &cfg.dir;
        fs::create_dir_all(dir).map_err(|e| unusable(dir, "cannot create the directory", e))?;
        let lock = take_lock(dir)?;
        let blocks_dir = dir.join("blocks");
        fs::create_dir_all(&blocks_dir).map_err(|e| unusable(dir, "cannot create blocks/", e))?;
        let probe = blocks_dir.join(".probe.tmp");
        fs::write(&probe, b"probe").map_err(|e| unusable(dir, "not writable", e))?;
        let _ = fs::remove_file(&probe);
        let store = DiskStore {
            dir: dir.to_path_buf(),
            blocks_dir,
            index: Mutex::new(DiskIndex::new(cfg.capacity_bytes)),
            ns: ns.clone(),
            secret: cfg.secret.clone(),
            fail_writes: AtomicBool::new(false),
            _lock: lock,
        };
        let report = store.rebuild(Instant::now() + REBUILD_LIMIT)?;
        Ok((store, report))
    }

    /// The directory (`--kv-tier-disk-path`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The namespace its values are written in (model, KV layout, block size).
    pub fn namespace(&self) -> &crate::TierNamespace {
        &self.ns
    }

    fn path(&self, h: &BlockHash) -> PathBuf {
        self.blocks_dir.join(file_name(h))
    }

    /// Reads every block file's header and indexes the ones of this namespace, least recently
    /// modified first.
    fn rebuild(&self, deadline: Instant) -> Result<RebuildReport, TierError> {
        let mut rep = RebuildReport::default();
        let entries = fs::read_dir(&self.blocks_dir)
            .map_err(|e| unusable(&self.blocks_dir, "cannot list", e))?;
        let want = header_len(&self.ns);
        let mut found: Vec<(SystemTime, BlockHash, u64)> = Vec::new();
        let mut head = vec![0u8; want];
        for entry in entries {
            if Instant::now() >= deadline {
                rep.unscanned += 1;
                continue;
            }
            let Ok(entry) = entry else {
                continue;
            };
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                continue;
            };
            let path = entry.path();
            if name.ends_with(".tmp") {
                // A write a crash interrupted.
                if fs::remove_file(&path).is_ok() {
                    rep.removed += 1;
                }
                continue;
            }
            let Some(hash) = parse_name(name) else {
                continue;
            };
            match examine(&path, &hash, &self.ns, &mut head) {
                Ok((len, mtime)) => found.push((mtime, hash, len)),
                Err(Examined::Foreign) => rep.foreign += 1,
                Err(Examined::Torn) => {
                    let _ = fs::remove_file(&path);
                    rep.removed += 1;
                }
            }
        }
        found.sort_by_key(|(t, _, _)| *t);
        let mut idx = lock(&self.index);
        for (_, hash, len) in found {
            idx.map.put(hash, len);
            idx.bytes += len;
            rep.blocks += 1;
            rep.bytes += len;
        }
        // A budget lowered since the files were written: the oldest go.
        while idx.bytes > idx.capacity {
            let Some((h, len)) = idx.map.pop_lru() else {
                break;
            };
            idx.bytes -= len;
            let _ = fs::remove_file(self.path(&h));
            rep.over_budget += 1;
            rep.blocks -= 1;
            rep.bytes -= len;
        }
        Ok(rep)
    }

    /// Whether the index holds `h`.
    pub fn contains(&self, h: &BlockHash) -> bool {
        lock(&self.index).contains(h)
    }

    /// Makes `h` most recently used; whether it is held.
    pub fn touch(&self, h: &BlockHash) -> bool {
        lock(&self.index).touch(h)
    }

    /// Blocks indexed, their bytes on disk, and the blocks evicted so far.
    pub fn usage(&self) -> (u64, u64, u64) {
        let i = lock(&self.index);
        (i.len() as u64, i.bytes(), i.evictions())
    }

    /// Test hook: make every following write fail (`true`) as a full disk would, or stop.
    pub fn inject_write_failure(&self, on: bool) {
        self.fail_writes.store(on, Relaxed);
    }

    /// Writes block `hash` (encoded, signed with the secret when there is one): a temporary
    /// file renamed into place, after evicting least recently used files to fit the budget.
    /// An I/O error (a full disk) leaves no file and no index entry.
    pub fn write(&self, hash: &BlockHash, payload: &[u8]) -> io::Result<DiskWrite> {
        let value = encode_value(&self.ns, hash, payload, self.secret.as_ref());
        let len = value.len() as u64;
        let gone = {
            let mut idx = lock(&self.index);
            if idx.touch(hash) {
                return Ok(DiskWrite::Held);
            }
            match idx.reserve(len) {
                Some(g) => g,
                None => return Ok(DiskWrite::TooLarge),
            }
        };
        for h in &gone {
            let _ = fs::remove_file(self.path(h));
        }
        let path = self.path(hash);
        let tmp = path.with_extension("tmp");
        let res = if self.fail_writes.load(Relaxed) {
            Err(io::Error::from_raw_os_error(libc::ENOSPC))
        } else {
            write_file(&tmp, &value).and_then(|()| fs::rename(&tmp, &path))
        };
        let mut idx = lock(&self.index);
        match res {
            Ok(()) => {
                // The bytes were reserved; now the entry.
                if let Some(old) = idx.map.put(*hash, len) {
                    idx.bytes -= old;
                }
                Ok(DiskWrite::Stored {
                    evicted: gone.len(),
                    value_bytes: len,
                })
            }
            Err(e) => {
                idx.bytes -= len;
                drop(idx);
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// Reads and checks block `hash`; its payload (a slice of the file's bytes). A file that
    /// fails a check is removed with its index entry; a read error drops the entry (the file
    /// stays); a block not indexed is [`LoadError::Missing`] without touching the disk.
    pub fn read(&self, hash: &BlockHash) -> Result<Bytes, LoadError> {
        if !self.touch(hash) {
            return Err(LoadError::Missing);
        }
        let path = self.path(hash);
        let bytes = match read_file(&path) {
            Ok(b) => b,
            Err(e) => {
                lock(&self.index).remove(hash);
                return Err(if e.kind() == io::ErrorKind::NotFound {
                    LoadError::Missing
                } else {
                    LoadError::Failed
                });
            }
        };
        match decode_value(&self.ns, hash, Bytes::from(bytes), self.secret.as_ref()) {
            Ok(p) => Ok(p),
            Err(e) => {
                lock(&self.index).remove(hash);
                let _ = fs::remove_file(&path);
                Err(e)
            }
        }
    }
}

/// Reads a whole block file and refreshes its modification time (its recency after a restart).
fn read_file(path: &Path) -> io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let mut buf = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    f.read_to_end(&mut buf)?;
    let _ = f.set_modified(SystemTime::now());
    Ok(buf)
}

fn write_file(path: &Path, value: &[u8]) -> io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(value)?;
    // No fsync: a block lost in a power cut is recomputed; a torn one fails its checksum.
    Ok(())
}

enum Examined {
    /// Another model, KV layout, block size or format version.
    Foreign,
    /// Unreadable, not a value, or of a length or block other than its name and header say.
    Torn,
}

/// A block file's length and modification time when its header belongs to `ns` and agrees with
/// its name and length.
fn examine(
    path: &Path,
    hash: &BlockHash,
    ns: &crate::TierNamespace,
    head: &mut [u8],
) -> Result<(u64, SystemTime), Examined> {
    let mut f = File::open(path).map_err(|_| Examined::Torn)?;
    let meta = f.metadata().map_err(|_| Examined::Torn)?;
    let len = meta.len();
    let n = read_up_to(&mut f, head).map_err(|_| Examined::Torn)?;
    match read_header(ns, &head[..n]) {
        Ok(h) if h.hash == *hash && h.total_len == len => {
            Ok((len, meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
        }
        Ok(_) => Err(Examined::Torn),
        Err(LoadError::ForeignLayout | LoadError::UnsupportedVersion(_)) => Err(Examined::Foreign),
        Err(_) => Err(Examined::Torn),
    }
}

fn read_up_to(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{CorruptKind, TierNamespace};

    fn ns() -> TierNamespace {
        TierNamespace {
            model_fingerprint: [7; 32],
            kv_layout: "sim:u64".into(),
            block_size: 16,
        }
    }

    fn h(i: u8) -> BlockHash {
        BlockHash([i; 32])
    }

    fn cfg(dir: &Path, capacity_bytes: u64, secret: Option<&str>) -> DiskConfig {
        DiskConfig {
            dir: dir.to_path_buf(),
            capacity_bytes,
            secret: secret.map(Secret::new),
            save_queue: 8,
            save_on_shutdown: false,
        }
    }

    /// 78 fixed header bytes + 7 layout + 8 length, 128 payload, 32 checksum.
    const VALUE: u64 = 78 + 7 + 8 + 128 + 32;

    fn open(c: &DiskConfig) -> (DiskStore, RebuildReport) {
        DiskStore::open(c, &ns()).unwrap()
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir.join("blocks"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn blocks_survive_a_reopen_and_the_least_recently_used_go_first() {
        let t = tempfile::tempdir().unwrap();
        let c = cfg(t.path(), 2 * VALUE, None);
        let (s, rep) = open(&c);
        assert_eq!(rep, RebuildReport::default());
        for i in 1..=2 {
            assert_eq!(
                s.write(&h(i), &[i; 128]).unwrap(),
                DiskWrite::Stored {
                    evicted: 0,
                    value_bytes: VALUE
                }
            );
        }
        assert_eq!(s.write(&h(1), &[1; 128]).unwrap(), DiskWrite::Held);
        // 1 was used last (the Held write touched it): 3 evicts 2.
        assert_eq!(
            s.write(&h(3), &[3; 128]).unwrap(),
            DiskWrite::Stored {
                evicted: 1,
                value_bytes: VALUE
            }
        );
        assert_eq!(s.usage(), (2, 2 * VALUE, 1));
        assert_eq!(s.read(&h(2)), Err(LoadError::Missing));
        assert_eq!(files(t.path()), vec![file_name(&h(1)), file_name(&h(3))]);
        assert_eq!(s.write(&h(9), &[9; 400]).unwrap(), DiskWrite::TooLarge);
        drop(s);

        let (s, rep) = open(&c);
        assert_eq!(
            (rep.blocks, rep.bytes, rep.removed, rep.foreign),
            (2, 2 * VALUE, 0, 0)
        );
        assert_eq!(s.read(&h(3)).unwrap().as_ref(), &[3u8; 128][..]);
        assert_eq!(s.read(&h(1)).unwrap().as_ref(), &[1u8; 128][..]);
        // A budget lowered below what is on disk: the least recently modified go at start.
        drop(s);
        std::thread::sleep(Duration::from_millis(20));
        let _ = read_file(&t.path().join("blocks").join(file_name(&h(3))));
        let (s, rep) = open(&cfg(t.path(), VALUE, None));
        assert_eq!((rep.blocks, rep.over_budget), (1, 1));
        assert!(s.contains(&h(3)) && !s.contains(&h(1)));
    }

    #[test]
    fn a_second_process_and_an_unwritable_path_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let c = cfg(t.path(), 1 << 20, None);
        let (_s, _) = open(&c);
        let Err(TierError::DiskUnusable(msg)) = DiskStore::open(&c, &ns()) else {
            panic!("a locked directory was opened twice");
        };
        assert!(msg.contains("in use by another cachet process"), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );

        // Under a regular file: cannot be created (root or not).
        let f = t.path().join("plain");
        fs::write(&f, b"x").unwrap();
        let Err(TierError::DiskUnusable(msg)) =
            DiskStore::open(&cfg(&f.join("kv"), 1 << 20, None), &ns())
        else {
            panic!("a path under a file was accepted");
        };
        assert!(msg.contains("cannot create the directory"), "{msg}");
    }

    #[test]
    fn torn_changed_and_foreign_files_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let c = cfg(t.path(), 1 << 20, None);
        let (s, _) = open(&c);
        for i in 1..=4 {
            s.write(&h(i), &[i; 128]).unwrap();
        }
        drop(s);
        let blocks = t.path().join("blocks");
        // 1: cut short (a crash mid-write without the rename, or a truncation).
        let f1 = OpenOptions::new()
            .write(true)
            .open(blocks.join(file_name(&h(1))))
            .unwrap();
        f1.set_len(VALUE - 10).unwrap();
        // 2: a payload byte changed (same length: found at load by the checksum).
        let p2 = blocks.join(file_name(&h(2)));
        let mut v = fs::read(&p2).unwrap();
        v[100] ^= 0xff;
        fs::write(&p2, &v).unwrap();
        // A crash's leftover temporary file.
        fs::write(blocks.join("ab.tmp"), b"half").unwrap();
        let (s, rep) = open(&c);
        assert_eq!((rep.blocks, rep.removed, rep.foreign), (3, 2, 0));
        assert!(!s.contains(&h(1)));
        assert_eq!(
            s.read(&h(2)),
            Err(LoadError::Corrupt(CorruptKind::Checksum))
        );
        assert!(
            !s.contains(&h(2)) && !p2.exists(),
            "a refused file is removed"
        );
        // 3: changed under the running server (cut after the index was built).
        let p3 = blocks.join(file_name(&h(3)));
        OpenOptions::new()
            .write(true)
            .open(&p3)
            .unwrap()
            .set_len(50)
            .unwrap();
        assert_eq!(
            s.read(&h(3)),
            Err(LoadError::Corrupt(CorruptKind::Truncated))
        );
        // 4: a read error (the file replaced by a directory): refused, dropped from the index.
        let p4 = blocks.join(file_name(&h(4)));
        fs::remove_file(&p4).unwrap();
        fs::create_dir(&p4).unwrap();
        assert_eq!(s.read(&h(4)), Err(LoadError::Failed));
        assert!(!s.contains(&h(4)));
        fs::remove_dir(&p4).unwrap();
        s.write(&h(5), &[5; 128]).unwrap();
        drop(s);

        // Another block size (or model, or layout): nothing indexed, the file left alone.
        let mut other = ns();
        other.block_size = 32;
        let (s, rep) = DiskStore::open(&c, &other).unwrap();
        assert_eq!((rep.blocks, rep.foreign, rep.removed), (0, 1, 0));
        assert_eq!(s.read(&h(5)), Err(LoadError::Missing));
        assert!(blocks.join(file_name(&h(5))).exists());
    }

    #[test]
    fn signed_files_need_the_secret() {
        let t = tempfile::tempdir().unwrap();
        let (s, _) = open(&cfg(t.path(), 1 << 20, Some("k1")));
        s.write(&h(1), &[1; 128]).unwrap();
        s.write(&h(2), &[2; 128]).unwrap();
        assert_eq!(s.read(&h(1)).unwrap().len(), 128);
        drop(s);
        let (s, rep) = open(&cfg(t.path(), 1 << 20, Some("k2")));
        assert_eq!(rep.blocks, 2);
        assert_eq!(s.read(&h(1)), Err(LoadError::BadSignature));
        drop(s);
        let (s, _) = open(&cfg(t.path(), 1 << 20, Some("k1")));
        assert_eq!(s.read(&h(2)).unwrap().as_ref(), &[2u8; 128][..]);
    }

    #[test]
    fn a_failed_write_leaves_no_file_and_no_entry() {
        let t = tempfile::tempdir().unwrap();
        let (s, _) = open(&cfg(t.path(), 1 << 20, None));
        s.inject_write_failure(true);
        let e = s.write(&h(1), &[1; 128]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(s.usage(), (0, 0, 0));
        assert!(files(t.path()).is_empty());
        s.inject_write_failure(false);
        assert!(matches!(
            s.write(&h(1), &[1; 128]),
            Ok(DiskWrite::Stored { .. })
        ));
        assert_eq!(s.usage(), (1, VALUE, 0));
    }

    #[test]
    fn file_names_round_trip() {
        let x = BlockHash([0xa5; 32]);
        assert_eq!(parse_name(&file_name(&x)), Some(x));
        assert_eq!(parse_name("zz.kv"), None);
        assert_eq!(parse_name(&"g".repeat(64)), None);
    }
}
