//! `--dump-routing FILE`: every routing decision as JSON Lines, one record per
//! (token, layer), documented in docs/FORMATS.md:
//! `{"seq": request id, "pos": token position, "phase": "prefill"|"decode",
//!   "layer": L, "experts": [ids by rank], "weights": [renormalised weights],
//!   "predicted": [ids by rank, when the backend predicted this layer from the one before]}`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::model::forward::RouteRecord;

/// Phase of the forward pass a record comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Prompt processing.
    Prefill,
    /// One-token decode windows.
    Decode,
}

/// An open routing dump.
pub struct RoutingDump {
    out: BufWriter<File>,
}

impl RoutingDump {
    /// Creates (truncates) the file. Errors: the path cannot be written.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(RoutingDump { out: BufWriter::new(File::create(path)?) })
    }

    /// Writes and clears `recs` for request `seq`.
    pub fn write(&mut self, seq: u64, phase: Phase, recs: &mut Vec<RouteRecord>) -> std::io::Result<()> {
        let phase = match phase {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        };
        for r in recs.drain(..) {
            let mut line = serde_json::json!({
                "seq": seq,
                "pos": r.pos,
                "phase": phase,
                "layer": r.layer,
                "experts": r.experts.iter().map(|e| e.0).collect::<Vec<_>>(),
                "weights": r.experts.iter().map(|e| e.1).collect::<Vec<_>>(),
            });
            if let Some(p) = r.predicted {
                line["predicted"] = p.into();
            }
            serde_json::to_writer(&mut self.out, &line)?;
            self.out.write_all(b"\n")?;
        }
        Ok(())
    }

    /// Flushes buffered records to the file.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}
