//! The parked sessions a disk tier keeps across a restart: `{path}/sessions.json`, written at
//! shutdown (a temporary file renamed into place) and read when the next process starts, beside
//! the block files that hold their KV. A file of another namespace (model, KV layout, block size)
//! or one that does not parse is ignored with one warning: its sessions start afresh.
//! Written and read on the engine thread, once each (shutdown and start), never while serving.

use std::fs;
use std::io;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use cachet_core::sessions::SessionRecord;
use serde::{Deserialize, Serialize};

use crate::TierNamespace;

const FILE: &str = "sessions.json";
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct SessionsFile {
    version: u32,
    /// [`namespace_id`] of the process that wrote it.
    namespace: String,
    /// When it was written (seconds since the Unix epoch): idle time goes on across the restart.
    written_at_unix_s: f64,
    sessions: Vec<SessionRecord>,
}

/// Names a namespace: BLAKE3 over the model fingerprint, the KV layout and the block size.
fn namespace_id(ns: &TierNamespace) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"cachet/disk-sessions/v1\0");
    h.update(&ns.model_fingerprint);
    h.update(ns.kv_layout.as_bytes());
    h.update(&ns.block_size.to_le_bytes());
    h.finalize().to_hex().to_string()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Writes `records` as the directory's sessions (replacing the last ones).
pub fn write(dir: &Path, ns: &TierNamespace, records: Vec<SessionRecord>) -> io::Result<()> {
    let file = SessionsFile {
        version: VERSION,
        namespace: namespace_id(ns),
        written_at_unix_s: unix_now(),
        sessions: records,
    };
    let bytes = serde_json::to_vec(&file).map_err(io::Error::other)?;
    let tmp = dir.join("sessions.json.tmp");
    fs::write(&tmp, bytes)?;
    fs::rename(&tmp, dir.join(FILE))
}

/// The sessions the last process wrote, their idle time advanced by the time since; empty when
/// there is no file, or it is of another namespace or does not parse (logged once).
pub fn read(dir: &Path, ns: &TierNamespace) -> Vec<SessionRecord> {
    let path = dir.join(FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the kept sessions");
            return Vec::new();
        }
    };
    let file: SessionsFile = match serde_json::from_slice(&bytes) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "kept sessions unreadable; ignored");
            return Vec::new();
        }
    };
    if file.version != VERSION || file.namespace != namespace_id(ns) {
        tracing::warn!(
            path = %path.display(),
            "kept sessions are of another model, KV layout or block size; ignored"
        );
        return Vec::new();
    }
    let since = (unix_now() - file.written_at_unix_s).max(0.0);
    file.sessions
        .into_iter()
        .map(|r| SessionRecord {
            idle_s: r.idle_s + since,
            ..r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(block_size: u32) -> TierNamespace {
        TierNamespace {
            model_fingerprint: [7; 32],
            kv_layout: "f16:L2:H1:D4".into(),
            block_size,
        }
    }

    fn record(key: &str) -> SessionRecord {
        SessionRecord {
            key: key.into(),
            tokens: vec![1, 2, 3],
            turns: 2,
            cache_salt: Some("s".into()),
            adapter: None,
            idle_s: 5.0,
        }
    }

    #[test]
    fn a_written_file_reads_back_in_its_namespace_only() {
        let dir = tempfile::tempdir().expect("tmp");
        assert!(read(dir.path(), &ns(16)).is_empty(), "no file: none");
        write(dir.path(), &ns(16), vec![record("a"), record("b")]).expect("write");
        let back = read(dir.path(), &ns(16));
        assert_eq!(back.len(), 2);
        assert_eq!(back[0].key, "a");
        assert_eq!((back[0].tokens.clone(), back[0].turns), (vec![1, 2, 3], 2));
        assert!(
            back[0].idle_s >= 5.0 && back[0].idle_s < 60.0,
            "{}",
            back[0].idle_s
        );
        assert!(read(dir.path(), &ns(32)).is_empty(), "another block size");
        fs::write(dir.path().join(FILE), b"{not json").expect("write");
        assert!(read(dir.path(), &ns(16)).is_empty(), "unreadable");
    }
}
