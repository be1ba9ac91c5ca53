//! The usage journal: each request's usage is on local disk before its answer ends, and the
//! request path still never waits on the database.
//!
//! Entries (one JSON line each) go into numbered segment files under `{data}/usage-journal/`.
//! One writer thread appends whatever has queued up since its last write and makes it
//! durable with one `fdatasync` (a group commit), then tells every request in that group.
//! The meter's flush (`usage_meter`) closes the current segment, writes the counts of every
//! closed segment to the database together with the number of the last one (the journal's
//! watermark, in the same transaction), and then the segments up to it are deleted. At start
//! the segments past the database's watermark are replayed into the store: a crash anywhere
//! (before the write, between the write and the deletion) neither loses nor double-counts.
//!
//! A replica owns its journal directory through an exclusive lock on `LOCK`; its id (in
//! `ID`) keys the watermark, so replicas sharing a database never confuse their journals.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::store::{UsageCounts, UsageKey};

/// Why a request's usage could not be made durable (disk full, I/O error, writer gone).
#[derive(Debug, Clone, thiserror::Error)]
#[error("usage journal: {0}")]
pub struct JournalError(pub Arc<str>);

/// One request's usage, as a journal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(rename = "t")]
    pub tenant_id: String,
    #[serde(rename = "m")]
    pub model: String,
    #[serde(rename = "d")]
    pub day: String,
    #[serde(rename = "i")]
    pub input_tokens: i64,
    #[serde(rename = "o")]
    pub output_tokens: i64,
    #[serde(rename = "e", default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Entry {
    pub fn key(&self) -> UsageKey {
        UsageKey {
            tenant_id: self.tenant_id.clone(),
            model: self.model.clone(),
            day: self.day.clone(),
        }
    }

    /// What this entry adds to its usage row.
    pub fn counts(&self) -> UsageCounts {
        let mut c = UsageCounts {
            requests: 1,
            input_tokens: self.input_tokens.max(0),
            output_tokens: self.output_tokens.max(0),
            ..UsageCounts::default()
        };
        if let Some(code) = &self.error {
            c.errors.insert(code.clone(), 1);
        }
        c
    }
}

/// Entries of one segment waiting for the writer, and who waits on them.
struct Chunk {
    segment: u64,
    bytes: Vec<u8>,
    waiters: Vec<oneshot::Sender<Result<(), JournalError>>>,
}

#[derive(Default)]
struct Queue {
    chunks: Vec<Chunk>,
    /// Delete the segments up to this one (their counts are in the database).
    delete_upto: Option<u64>,
    closing: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
}

/// The open journal of this replica.
pub struct UsageJournal {
    id: String,
    dir: PathBuf,
    shared: Arc<Shared>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Held until [`UsageJournal::close`]: the directory is this journal's alone.
    lock: Mutex<Option<File>>,
}

/// What is on disk when a journal opens: entries of the segments past the watermark.
pub struct Recovered {
    /// Every segment found (the ones at or under the watermark are already in the database).
    pub segments: Vec<u64>,
    /// The entries of the segments past the watermark, in order.
    pub entries: Vec<Entry>,
    /// Lines that were not whole entries: a write cut short, never acknowledged.
    pub torn_lines: usize,
}

impl UsageJournal {
    /// Open (or create) the journal in `dir`, taking its lock. Fails when another process
    /// holds it: two replicas must not share one journal.
    pub fn open(dir: &Path) -> Result<UsageJournal, JournalError> {
        std::fs::create_dir_all(dir).map_err(|e| io_error("creating the directory", e))?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("LOCK"))
            .map_err(|e| io_error("opening LOCK", e))?;
        lock.try_lock().map_err(|_| {
            JournalError(
                format!(
                    "{} is in use by another process (each replica needs its own data directory)",
                    dir.display()
                )
                .into(),
            )
        })?;
        let id_path = dir.join("ID");
        let id = match std::fs::read_to_string(&id_path) {
            Ok(id) if !id.trim().is_empty() => id.trim().to_string(),
            _ => {
                let id = uuid::Uuid::new_v4().to_string();
                write_durably(&id_path, id.as_bytes()).map_err(|e| io_error("writing ID", e))?;
                sync_dir(dir).map_err(|e| io_error("syncing the directory", e))?;
                id
            }
        };
        Ok(UsageJournal {
            id,
            dir: dir.to_path_buf(),
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue::default()),
                wake: Condvar::new(),
            }),
            writer: Mutex::new(None),
            lock: Mutex::new(Some(lock)),
        })
    }

    /// This journal's id: the key of its watermark in the database.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Read every segment on disk; entries of segments after `watermark` are returned.
    pub fn recover(&self, watermark: u64) -> Result<Recovered, JournalError> {
        let mut segments = list_segments(&self.dir).map_err(|e| io_error("listing", e))?;
        segments.sort_unstable();
        let mut entries = Vec::new();
        let mut torn_lines = 0;
        for &s in segments.iter().filter(|&&s| s > watermark) {
            let file = File::open(segment_path(&self.dir, s))
                .map_err(|e| io_error("opening a segment", e))?;
            let mut reader = BufReader::new(file);
            let mut line = Vec::new();
            loop {
                line.clear();
                let n = reader
                    .read_until(b'\n', &mut line)
                    .map_err(|e| io_error("reading a segment", e))?;
                if n == 0 {
                    break;
                }
                // A line without its newline, or not an entry, was cut short by a failed or
                // interrupted write: it was never acknowledged to anyone.
                match line
                    .strip_suffix(b"\n")
                    .map(serde_json::from_slice::<Entry>)
                {
                    Some(Ok(e)) => entries.push(e),
                    _ => torn_lines += 1,
                }
            }
        }
        Ok(Recovered {
            segments,
            entries,
            torn_lines,
        })
    }

    /// Delete the segments the database already has (up to `watermark`), then start the
    /// writer thread.
    pub fn start(&self, watermark: u64) {
        let mut none = None;
        delete_segments(&self.dir, watermark, &mut none);
        let shared = self.shared.clone();
        let dir = self.dir.clone();
        let handle = std::thread::Builder::new()
            .name("usage-journal".into())
            .spawn(move || write_loop(&shared, &dir))
            .expect("spawning the usage journal writer");
        *self.writer.lock() = Some(handle);
    }

    /// Queue `entry` in `segment`; the receiver answers once it is durable (or failed).
    pub fn append(
        &self,
        segment: u64,
        entry: &Entry,
    ) -> oneshot::Receiver<Result<(), JournalError>> {
        let (tx, rx) = oneshot::channel();
        let mut line = serde_json::to_vec(entry).expect("an entry serializes");
        line.push(b'\n');
        let mut q = self.shared.queue.lock();
        if q.closing {
            let _ = tx.send(Err(JournalError("the journal is closed".into())));
            return rx;
        }
        match q.chunks.last_mut() {
            Some(c) if c.segment == segment => {
                c.bytes.extend_from_slice(&line);
                c.waiters.push(tx);
            }
            _ => q.chunks.push(Chunk {
                segment,
                bytes: line,
                waiters: vec![tx],
            }),
        }
        drop(q);
        self.shared.wake.notify_one();
        rx
    }

    /// The counts of every segment up to `segment` are in the database: delete those files.
    pub fn applied(&self, segment: u64) {
        let mut q = self.shared.queue.lock();
        q.delete_upto = Some(q.delete_upto.map_or(segment, |d| d.max(segment)));
        drop(q);
        self.shared.wake.notify_one();
    }

    /// Write what is queued, stop the writer and give up the directory: a later `append`
    /// fails, and another journal (a restart in the same process) may open it.
    pub fn close(&self) {
        self.shared.queue.lock().closing = true;
        self.shared.wake.notify_one();
        if let Some(h) = self.writer.lock().take() {
            let _ = h.join();
        }
        self.lock.lock().take();
    }
}

impl Drop for UsageJournal {
    fn drop(&mut self) {
        self.close();
    }
}

fn io_error(what: &str, e: std::io::Error) -> JournalError {
    JournalError(format!("{what}: {e}").into())
}

fn segment_path(dir: &Path, segment: u64) -> PathBuf {
    dir.join(format!("{segment:020}.log"))
}

fn list_segments(dir: &Path) -> std::io::Result<Vec<u64>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let name = e?.file_name();
        if let Some(n) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse().ok())
        {
            out.push(n);
        }
    }
    Ok(out)
}

fn write_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// A new file's name is durable only once its directory is.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The segment file being appended to.
struct Open {
    segment: u64,
    file: File,
    /// Bytes known good: a failed write is cut back to here.
    len: u64,
}

/// The writer thread: take everything queued, append it, `fdatasync` once, answer every
/// waiter; then delete what the database has. Until `close`.
fn write_loop(shared: &Shared, dir: &Path) {
    let mut open: Option<Open> = None;
    loop {
        let (chunks, delete_upto, closing) = {
            let mut q = shared.queue.lock();
            while q.chunks.is_empty() && q.delete_upto.is_none() && !q.closing {
                shared.wake.wait(&mut q);
            }
            (
                std::mem::take(&mut q.chunks),
                q.delete_upto.take(),
                q.closing,
            )
        };
        let mut done = Vec::new();
        let mut result: Result<(), JournalError> = Ok(());
        for chunk in chunks {
            if result.is_ok() {
                result = append_chunk(dir, &mut open, &chunk);
            }
            done.push(chunk.waiters);
        }
        if result.is_ok()
            && let Some(o) = &open
        {
            // One fdatasync for the whole group (the segment switches above synced theirs).
            result = o.file.sync_data().map_err(|e| io_error("fdatasync", e));
        }
        if let Err(e) = &result {
            tracing::error!("{e}");
            // Whatever was half-written is cut off, so the next write starts a whole line.
            if let Some(o) = &open
                && o.file.set_len(o.len).is_err()
            {
                open = None;
            }
        } else if let Some(o) = &mut open {
            o.len = o.file.metadata().map(|m| m.len()).unwrap_or(o.len);
        }
        for waiters in done {
            for w in waiters {
                let _ = w.send(result.clone());
            }
        }
        if let Some(upto) = delete_upto {
            delete_segments(dir, upto, &mut open);
        }
        if closing && shared.queue.lock().chunks.is_empty() {
            return;
        }
    }
}

/// Append one chunk to its segment, switching files (and syncing the one left) as needed.
fn append_chunk(dir: &Path, open: &mut Option<Open>, chunk: &Chunk) -> Result<(), JournalError> {
    if open.as_ref().map(|o| o.segment) != Some(chunk.segment) {
        if let Some(o) = open.take() {
            o.file.sync_data().map_err(|e| io_error("fdatasync", e))?;
        }
        let path = segment_path(dir, chunk.segment);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| io_error("opening a segment", e))?;
        let len = file.metadata().map_err(|e| io_error("stat", e))?.len();
        sync_dir(dir).map_err(|e| io_error("syncing the directory", e))?;
        *open = Some(Open {
            segment: chunk.segment,
            file,
            len,
        });
    }
    let o = open.as_mut().expect("opened above");
    (&o.file)
        .write_all(&chunk.bytes)
        .map_err(|e| io_error("write", e))
}

/// Delete the segments up to `upto`. Nothing is written to them any more: the meter moved to
/// a newer segment before their counts went to the database, and the writer took every chunk
/// queued before this deletion was asked for.
fn delete_segments(dir: &Path, upto: u64, open: &mut Option<Open>) {
    if open.as_ref().is_some_and(|o| o.segment <= upto) {
        *open = None;
    }
    let Ok(segments) = list_segments(dir) else {
        return;
    };
    for s in segments.into_iter().filter(|&s| s <= upto) {
        if let Err(e) = std::fs::remove_file(segment_path(dir, s)) {
            tracing::warn!("usage journal: deleting segment {s}: {e}");
        }
    }
}
