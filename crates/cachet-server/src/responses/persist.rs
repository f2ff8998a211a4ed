//! Stored responses across a restart: one JSON file (`responses.json` in the disk tier's
//! directory, named by the binary), written at shutdown after the drain (a temporary file
//! renamed into place) and read at start. A file that does not parse is ignored with a warning:
//! the responses start afresh.

use std::fs;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::store::StoredResponse;

const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct ResponsesFile {
    version: u32,
    responses: Vec<StoredResponse>,
}

pub(super) fn write(file: &Path, records: &[StoredResponse]) -> io::Result<()> {
    let bytes = serde_json::to_vec(&ResponsesFile {
        version: VERSION,
        responses: records.to_vec(),
    })
    .map_err(io::Error::other)?;
    let tmp = file.with_extension("json.tmp");
    fs::write(&tmp, bytes)?;
    fs::rename(&tmp, file)
}

pub(super) fn read(file: &Path) -> Vec<StoredResponse> {
    let bytes = match fs::read(file) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %file.display(), error = %e, "cannot read the kept responses");
            return Vec::new();
        }
    };
    match serde_json::from_slice::<ResponsesFile>(&bytes) {
        Ok(f) if f.version == VERSION => f.responses,
        Ok(_) | Err(_) => {
            tracing::warn!(path = %file.display(), "kept responses unreadable; ignored");
            Vec::new()
        }
    }
}
