//! The usage journal: each request's usage is on local disk before its answer ends, and the
//! request path still never waits on the database.
//!
//! Entries (one JSON line each, numbered by a sequence number) are appended to segment files
//! under `{data}/usage-journal/`, each named by the first number in it. A request writes its
//! own line (one `write`, no hand-off to another thread); one sync thread makes whatever was
//! written since its last round durable with one `fdatasync` (a group commit), outside the
//! lock the writers take, then answers every request of that round. The meter's flush
//! (`usage_meter`) writes its table to the database together with the number of the last
//! entry it covers (the journal's watermark, in the same transaction); segments wholly at or
//! under the watermark are then deleted. At start the entries past the database's watermark
//! are replayed: a crash anywhere (before the database write, between it and the deletion)
//! neither loses nor double-counts. A segment is closed once it passes
//! [`SEGMENT_BYTES`], so a new file (and the directory sync it needs) is rare.
//!
//! Segments are preallocated (PostgreSQL does the same with its WAL): a helper thread keeps
//! a `spare` file of zeros, written and synced ahead, which the next segment is renamed from.
//! Lines then overwrite blocks that already exist, so each group's `fdatasync` flushes data
//! only, never the file's size or extents (on ext4 it skips the journal commit: about a
//! third less time per sync here). A segment's entries end at its first zero byte.
//!
//! A replica owns its journal directory through an exclusive lock on `LOCK`; its id (in
//! `ID`) keys the watermark, so replicas sharing a database never confuse their journals.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::store::{UsageCounts, UsageKey};

/// A segment is closed, and the next entry starts a new one, past this size.
pub const SEGMENT_BYTES: u64 = 8 << 20;

/// The zeros a spare segment is made of: a segment's size with room for its last line.
pub const PREALLOCATED_BYTES: u64 = SEGMENT_BYTES + (64 << 10);

/// The preallocated file the next segment is renamed from.
const SPARE: &str = "spare";

/// How far a request's usage is written before its answer ends (`usage_sync` in the serve
/// config). Either way it survives the process: a crash, `kill -9`, an OOM kill.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// On the disk itself (`fdatasync` of each group) before the answer ends: it also
    /// survives the machine losing power. Costs the disk's flush latency per request.
    #[default]
    Fdatasync,
    /// In the kernel's page cache (`write`) before the answer ends, on the disk within
    /// [`BACKGROUND_SYNC`]: a power loss may lose that much.
    Write,
}

/// How often [`SyncMode::Write`] makes what was written durable.
pub const BACKGROUND_SYNC: std::time::Duration = std::time::Duration::from_millis(100);

/// Why a request's usage could not be made durable (disk full, I/O error, journal closed).
#[derive(Debug, Clone, thiserror::Error)]
#[error("usage journal: {0}")]
pub struct JournalError(pub Arc<str>);

/// One request's usage, as a journal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Its sequence number in this journal: 1, 2, ... without gaps.
    #[serde(rename = "s")]
    pub seq: u64,
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
    /// Input tokens served from the prefix cache (part of `input_tokens`).
    #[serde(rename = "c", default, skip_serializing_if = "is_zero")]
    pub cached_input_tokens: i64,
    #[serde(rename = "e", default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
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
            cached_input_tokens: self.cached_input_tokens.max(0),
            ..UsageCounts::default()
        };
        if let Some(code) = &self.error {
            c.errors.insert(code.clone(), 1);
        }
        c
    }
}

type Waiter = oneshot::Sender<Result<(), JournalError>>;

/// The journal's state, shared by the requests that append and the sync thread.
#[derive(Default)]
struct State {
    /// The segment being appended to.
    open: Option<Open>,
    /// Segments closed since the last sync, to be synced with it.
    closed: Vec<Arc<File>>,
    /// A segment was created since the last sync: the directory needs one too.
    dir_dirty: bool,
    /// When the oldest write not yet on the disk was made.
    dirty_since: Option<std::time::Instant>,
    /// [`SyncMode::Fdatasync`]: requests whose entries are written, waiting for the sync.
    waiters: Vec<Waiter>,
    /// Delete the segments whose entries are all at or under this number.
    applied: Option<u64>,
    closing: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    /// A thread is writing the next spare segment.
    preparing_spare: std::sync::atomic::AtomicBool,
}

/// The open journal of this replica.
pub struct UsageJournal {
    id: String,
    dir: PathBuf,
    sync: SyncMode,
    shared: Arc<Shared>,
    syncer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Held until [`UsageJournal::close`]: the directory is this journal's alone.
    lock: Mutex<Option<File>>,
}

/// What is on disk when a journal opens.
pub struct Recovered {
    /// The entries past the watermark, in order.
    pub entries: Vec<Entry>,
    /// The highest sequence number on disk (0 when there is none).
    pub last_seq: u64,
    /// Lines that were not whole entries: a write cut short, never acknowledged.
    pub torn_lines: usize,
}

impl UsageJournal {
    /// Open (or create) the journal in `dir`, taking its lock. Fails when another process
    /// holds it: two replicas must not share one journal.
    pub fn open(dir: &Path, sync: SyncMode) -> Result<UsageJournal, JournalError> {
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
            sync,
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
                preparing_spare: Default::default(),
            }),
            syncer: Mutex::new(None),
            lock: Mutex::new(Some(lock)),
        })
    }

    /// This journal's id: the key of its watermark in the database.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Read every segment on disk: the entries after `watermark` are returned.
    pub fn recover(&self, watermark: u64) -> Result<Recovered, JournalError> {
        let mut entries = Vec::new();
        let mut torn_lines = 0;
        let mut last_seq = 0;
        for (_, path) in segments(&self.dir).map_err(|e| io_error("listing", e))? {
            let bytes = File::open(&path)
                .and_then(|f| entry_bytes(&f))
                .map_err(|e| io_error("reading a segment", e))?;
            // A line without its newline, or not an entry, was cut short by a failed or
            // interrupted write: it was never acknowledged to anyone.
            for line in bytes.split_inclusive(|&b| b == b'\n') {
                match line
                    .strip_suffix(b"\n")
                    .map(serde_json::from_slice::<Entry>)
                {
                    Some(Ok(e)) => {
                        last_seq = last_seq.max(e.seq);
                        if e.seq > watermark {
                            entries.push(e);
                        }
                    }
                    _ => torn_lines += 1,
                }
            }
        }
        Ok(Recovered {
            entries,
            last_seq,
            torn_lines,
        })
    }

    /// Delete the segments the database already has (at or under `watermark`), then start
    /// the sync thread.
    pub fn start(&self, watermark: u64) {
        delete_applied(&self.dir, watermark, &self.shared);
        delete_partial_spares(&self.dir);
        prepare_spare_in_background(&self.dir, &self.shared);
        let shared = self.shared.clone();
        let dir = self.dir.clone();
        let sync = self.sync;
        let handle = std::thread::Builder::new()
            .name("usage-journal".into())
            .spawn(move || sync_loop(&shared, &dir, sync))
            .expect("spawning the usage journal's sync thread");
        *self.syncer.lock() = Some(handle);
    }

    /// Write `entry` (whose number follows the last one's) to the journal, on the calling
    /// thread: one `write` to the page cache, a few microseconds. The receiver answers once
    /// the entry is as durable as the [`SyncMode`] asks: at once in [`SyncMode::Write`],
    /// after the next group's `fdatasync` (on the sync thread) in [`SyncMode::Fdatasync`].
    /// Callers append in sequence order (the meter numbers entries under its own lock).
    pub fn append(&self, entry: &Entry) -> oneshot::Receiver<Result<(), JournalError>> {
        let (tx, rx) = oneshot::channel();
        let mut line = serde_json::to_vec(entry).expect("an entry serializes");
        line.push(b'\n');
        let mut st = self.shared.state.lock();
        if st.closing {
            let _ = tx.send(Err(JournalError("the journal is closed".into())));
            return rx;
        }
        if let Err(e) = write_line(&self.dir, &self.shared, &mut st, entry.seq, &line) {
            tracing::error!("{e}");
            let _ = tx.send(Err(e));
            return rx;
        }
        let first_dirty = st.dirty_since.is_none();
        st.dirty_since.get_or_insert_with(std::time::Instant::now);
        match self.sync {
            SyncMode::Write => {
                let _ = tx.send(Ok(()));
                drop(st);
                if first_dirty {
                    self.shared.wake.notify_one();
                }
            }
            SyncMode::Fdatasync => {
                st.waiters.push(tx);
                drop(st);
                self.shared.wake.notify_one();
            }
        }
        rx
    }

    /// Every entry up to `seq` is counted in the database: its segments may go.
    pub fn applied(&self, seq: u64) {
        let mut st = self.shared.state.lock();
        st.applied = Some(st.applied.map_or(seq, |a| a.max(seq)));
        drop(st);
        self.shared.wake.notify_one();
    }

    /// Sync what is written, stop the sync thread and give up the directory: a later
    /// `append` fails, and another journal (a restart in the same process) may open it.
    pub fn close(&self) {
        self.shared.state.lock().closing = true;
        self.shared.wake.notify_one();
        if let Some(h) = self.syncer.lock().take() {
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

/// The segment files, by the number of their first entry.
fn segments(dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let path = e?.path();
        let first = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse().ok());
        if let Some(first) = first {
            out.push((first, path));
        }
    }
    out.sort_unstable();
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
    first_seq: u64,
    /// Shared with the sync thread, which syncs it outside the state's lock.
    file: Arc<File>,
    /// Bytes known good: a failed write is cut back to here.
    len: u64,
    /// A failed write could not be cut back: the next write starts with a newline, which
    /// ends the torn line (replay skips it).
    torn: bool,
    /// A write failed: the next one opens the file again by its name (an operator may have
    /// replaced what was behind it).
    failed: bool,
}

impl Open {
    /// Open the segment starting at `first_seq`: the file of that name where there is one
    /// (written up to its first zero byte), else the spare renamed to it, else a new empty
    /// file. Its name is durable once the directory is synced, which the sync thread does
    /// before it acknowledges any entry. Says whether it took the spare.
    fn create(dir: &Path, first_seq: u64) -> Result<(Open, bool), JournalError> {
        let path = dir.join(format!("{first_seq:020}.log"));
        let took_spare = !path.exists() && std::fs::rename(dir.join(SPARE), &path).is_ok();
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_error("opening a segment", e))?;
        let len = if took_spare {
            0
        } else {
            entry_bytes(&file)
                .map_err(|e| io_error("reading a segment", e))?
                .len() as u64
        };
        let open = Open {
            first_seq,
            file: Arc::new(file),
            len,
            torn: false,
            failed: false,
        };
        Ok((open, took_spare))
    }
}

/// The part of a segment that holds entries: its bytes up to the first zero byte (the rest
/// is preallocated, never written) or its end. Read in pieces, never past that zero (a
/// device such as `/dev/full` reads as zeros without end).
fn entry_bytes(segment: &File) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut piece = vec![0u8; 64 << 10];
    loop {
        let n = segment.read_at(&mut piece, out.len() as u64)?;
        let read = &piece[..n];
        if let Some(zero) = read.iter().position(|&b| b == 0) {
            out.extend_from_slice(&read[..zero]);
            return Ok(out);
        }
        if n == 0 {
            return Ok(out);
        }
        out.extend_from_slice(read);
    }
}

/// Delete spares a crash left half written (each is its own `spare.{uuid}.partial`).
fn delete_partial_spares(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(SPARE) && name.ends_with(".partial") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Write the next spare segment (zeros, synced, then renamed into place) on a thread of its
/// own, unless one is there or being written: the sync thread never waits for it.
fn prepare_spare_in_background(dir: &Path, shared: &Arc<Shared>) {
    use std::sync::atomic::Ordering;
    let spare = dir.join(SPARE);
    if std::fs::metadata(&spare).is_ok_and(|m| m.len() == PREALLOCATED_BYTES)
        || shared.preparing_spare.swap(true, Ordering::AcqRel)
    {
        return;
    }
    let done = shared.clone();
    let dir = dir.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("usage-journal-spare".into())
        .spawn(move || {
            let partial = dir.join(format!("{SPARE}.{}.partial", uuid::Uuid::new_v4()));
            let zeros = vec![0u8; 1 << 20];
            let written = (|| {
                let mut f = File::create(&partial)?;
                let mut left = PREALLOCATED_BYTES;
                while left > 0 {
                    let n = left.min(zeros.len() as u64) as usize;
                    f.write_all(&zeros[..n])?;
                    left -= n as u64;
                }
                f.sync_all()?;
                std::fs::rename(&partial, dir.join(SPARE))
            })();
            if let Err(e) = written {
                // The next segment then grows as it is written: slower syncs, nothing lost.
                tracing::warn!("usage journal: preparing a spare segment: {e}");
                let _ = std::fs::remove_file(&partial);
            }
            done.preparing_spare.store(false, Ordering::Release);
        });
    if spawned.is_err() {
        shared.preparing_spare.store(false, Ordering::Release);
    }
}

/// Append one line (entry `seq`) to the open segment, starting a new one past
/// [`SEGMENT_BYTES`]. A failure cuts off whatever was half written, so the next line starts
/// whole (or, when even that fails, ends the torn line with the next write's first byte).
fn write_line(
    dir: &Path,
    shared: &Arc<Shared>,
    st: &mut State,
    seq: u64,
    line: &[u8],
) -> Result<(), JournalError> {
    if st.open.as_ref().is_some_and(|o| o.len >= SEGMENT_BYTES) {
        // Closed; the sync thread syncs it with the next group. This entry starts the next.
        let full = st.open.take().expect("checked above");
        st.closed.push(full.file);
    }
    if let Some(o) = st.open.as_mut().filter(|o| o.failed) {
        let torn = o.torn;
        *o = Open::create(dir, o.first_seq)?.0;
        o.torn = torn && o.len > 0;
        st.dir_dirty = true;
    }
    if st.open.is_none() {
        let (open, took_spare) = Open::create(dir, seq)?;
        st.open = Some(open);
        st.dir_dirty = true;
        if took_spare {
            prepare_spare_in_background(dir, shared);
        }
    }
    let o = st.open.as_mut().expect("opened above");
    let newline: &[u8] = if o.torn { b"\n" } else { b"" };
    let written = o
        .file
        .write_all_at(newline, o.len)
        .and_then(|()| o.file.write_all_at(line, o.len + newline.len() as u64))
        .map_err(|e| io_error("write", e));
    match written {
        Ok(()) => {
            o.len += (newline.len() + line.len()) as u64;
            o.torn = false;
            Ok(())
        }
        Err(e) => {
            // Cut back to the last whole line (which also gives up the preallocation: a
            // failed disk is no place to keep it).
            o.torn = o.file.set_len(o.len).is_err();
            o.failed = true;
            Err(e)
        }
    }
}

/// Something written waits for the sync: a request (`Fdatasync`), or the background
/// interval is up (`Write`).
fn sync_due(sync: SyncMode, st: &State) -> bool {
    match (sync, st.dirty_since) {
        (_, None) => false,
        (SyncMode::Fdatasync, Some(_)) => !st.waiters.is_empty(),
        (SyncMode::Write, Some(t)) => t.elapsed() >= BACKGROUND_SYNC,
    }
}

/// The sync thread: put what was written on the disk with one `fdatasync` per group
/// (segments closed since the last one, the open one, the directory when a segment was
/// created) and answer the group's waiters; in [`SyncMode::Write`] every
/// [`BACKGROUND_SYNC`]. Then delete what the database has. Until `close`.
fn sync_loop(shared: &Shared, dir: &Path, sync: SyncMode) {
    loop {
        let (waiters, files, dir_dirty, applied, closing) = {
            let mut st = shared.state.lock();
            while !sync_due(sync, &st) && st.applied.is_none() && !st.closing {
                match (sync, st.dirty_since) {
                    (SyncMode::Write, Some(t)) => {
                        shared.wake.wait_until(&mut st, t + BACKGROUND_SYNC);
                    }
                    _ => shared.wake.wait(&mut st),
                }
            }
            let mut files = Vec::new();
            let mut dir_dirty = false;
            if (sync_due(sync, &st) || st.closing) && st.dirty_since.is_some() {
                st.dirty_since = None;
                files = std::mem::take(&mut st.closed);
                files.extend(st.open.as_ref().map(|o| o.file.clone()));
                dir_dirty = std::mem::take(&mut st.dir_dirty);
            }
            (
                std::mem::take(&mut st.waiters),
                files,
                dir_dirty,
                st.applied.take(),
                st.closing,
            )
        };
        // Outside the lock: requests go on writing while the disk flushes.
        let mut result = Ok(());
        if dir_dirty && let Err(e) = sync_dir(dir) {
            result = Err(io_error("syncing the directory", e));
        }
        for f in &files {
            if let Err(e) = f.sync_data() {
                result = Err(io_error("fdatasync", e));
            }
        }
        if let Err(e) = &result {
            tracing::error!("{e}");
        }
        for w in waiters {
            let _ = w.send(result.clone());
        }
        if let Some(seq) = applied {
            delete_applied(dir, seq, shared);
        }
        if closing {
            return;
        }
    }
}

/// Delete the segments whose entries are all at or under `applied`: every segment but the
/// last whose successor starts at or before `applied + 1`. The open segment, always the
/// last, never goes.
fn delete_applied(dir: &Path, applied: u64, shared: &Shared) {
    let Ok(all) = segments(dir) else {
        return;
    };
    for pair in all.windows(2) {
        let ((first, path), (next_first, _)) = (&pair[0], &pair[1]);
        if *next_first > applied.saturating_add(1) {
            break;
        }
        if shared
            .state
            .lock()
            .open
            .as_ref()
            .is_some_and(|o| o.first_seq == *first)
        {
            continue;
        }
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!("usage journal: deleting {}: {e}", path.display());
        }
    }
}
