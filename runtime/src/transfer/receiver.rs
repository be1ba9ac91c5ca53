//! The decode side of a KV transfer: accept connections from prefill nodes, admit, receive
//! and verify the pages into this node's pool, then generate and stream events back.
//!
//! Each connection starts with this node's challenge; nothing is reserved until an
//! authentic `Hello` (MAC'd under the cluster's transfer key, bound to the challenge) says
//! who the request is, and the pages are imported under that Hello's tenant. Everything
//! received is checked against the handshake before the request may run: every frame's MAC,
//! the layout, the declared token count against the prompt, every page's owner, position
//! and token count, and the commit's totals against what actually arrived. Page bytes go
//! straight into the sequence's own reserved pages, which nothing reads before the commit
//! verifies; until the request is handed to the engine they are owned by a guard that
//! releases (and poisons) them on any failure, timeout or lost connection.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

use super::TransferConfig;
use super::wire::{
    self, ErrorFrame, Frame, FrameHead, FrameReader, FrameWriter, Hello, Kind, WireEvent,
};
use crate::admission::check_generation;
use crate::engine::{Engine, Submission};
use crate::error::{RuntimeError, TransferError};
use crate::kv::{KvPool, SeqKv};
use crate::metrics::side;
use crate::node::Node;

/// Accept transfers on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, node: Arc<Node>, cfg: TransferConfig) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(handle(stream, node.clone(), cfg.clone()));
            }
            Err(e) => {
                tracing::warn!("transfer accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A received sequence's pages until the engine takes them: released on drop.
struct KvGuard {
    pool: Arc<KvPool>,
    kv: Option<SeqKv>,
}

impl KvGuard {
    fn seq(&mut self) -> &mut SeqKv {
        self.kv.as_mut().expect("taken only once")
    }
    fn take(mut self) -> SeqKv {
        self.kv.take().expect("taken only once")
    }
}

impl Drop for KvGuard {
    fn drop(&mut self) {
        if let Some(kv) = &mut self.kv {
            self.pool.release(kv);
        }
    }
}

/// How long a refusing receiver keeps reading (and dropping) what the sender still sends,
/// so that the sender gets the refusal rather than a reset connection.
const REFUSAL_DRAIN: Duration = Duration::from_secs(2);

/// Where a failed transfer stopped: before `Accept` the answer is `Reject`, after it `Nack`.
struct Failure {
    accepted: bool,
    error: RuntimeError,
}

async fn handle(stream: TcpStream, node: Arc<Node>, cfg: TransferConfig) {
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    // Small: page data goes straight into the pool, not through this buffer.
    let mut rd = BufReader::with_capacity(16 << 10, rd);
    let metrics = node.metrics.clone();
    metrics
        .transfers_started
        .get_or_create(&side(super::RECEIVE))
        .inc();
    let key = match cfg.require_key() {
        Ok(k) => k.clone(),
        Err(e) => {
            // `Node::start` refuses a decode node without a key; this is the last line.
            tracing::error!("KV transfer refused: {e}");
            metrics.transfer_failed(super::RECEIVE, &e);
            return;
        }
    };
    let Ok((mut tx, mut rx)) = wire::write_challenge(&mut wr, &key).await else {
        metrics.transfer_failed(
            super::RECEIVE,
            &TransferError::PeerClosed("before the challenge".into()).into(),
        );
        return;
    };
    let lease = Duration::from_millis(cfg.lease_ms);
    let mut accepted = false;
    let received = tokio::time::timeout(
        lease,
        receive(
            &mut rd,
            &mut wr,
            (&mut tx, &mut rx),
            &node,
            &cfg,
            &mut accepted,
        ),
    )
    .await
    .unwrap_or_else(|_| {
        Err(Failure {
            accepted,
            error: TransferError::LeaseExpired {
                lease_ms: cfg.lease_ms,
            }
            .into(),
        })
    });
    let sub = match received {
        Ok(sub) => sub,
        Err(f) => {
            tracing::warn!("KV transfer refused: {}", f.error);
            metrics.transfer_failed(super::RECEIVE, &f.error);
            let kind = if f.accepted { Kind::Nack } else { Kind::Reject };
            let _ = tx
                .write_frame(&mut wr, kind, &ErrorFrame { error: f.error }, &[])
                .await;
            // Closing with the sender's bytes unread would reset the connection, and a reset
            // can destroy the refusal before the sender reads it: end our side, then read
            // and drop what it still sends until it closes (bounded in time).
            let _ = wr.shutdown().await;
            let _ = tokio::time::timeout(
                REFUSAL_DRAIN,
                tokio::io::copy(&mut rd, &mut tokio::io::sink()),
            )
            .await;
            return;
        }
    };
    if tx.write_empty(&mut wr, Kind::Ack).await.is_err() {
        // Prefill is gone: dropping the submission cancels the generation.
        metrics.transfer_failed(
            super::RECEIVE,
            &TransferError::PeerClosed("before the acknowledgement".into()).into(),
        );
        return;
    }
    metrics
        .transfers_committed
        .get_or_create(&side(super::RECEIVE))
        .inc();
    stream_events(
        sub,
        &mut rd,
        &mut wr,
        (&mut tx, &mut rx),
        cfg.max_frame_bytes,
    )
    .await;
}

/// Send generation events until the end; stop (and so cancel) when prefill hangs up.
async fn stream_events(
    mut sub: Submission,
    rd: &mut BufReader<OwnedReadHalf>,
    wr: &mut OwnedWriteHalf,
    (tx, rx): (&mut FrameWriter, &mut FrameReader),
    max_frame: usize,
) {
    loop {
        let ev = tokio::select! {
            ev = sub.events.recv() => ev,
            // Prefill sends nothing after the commit: any frame or EOF here means it left.
            _ = rx.read_frame(rd, max_frame) => return,
        };
        let wire_ev = match ev {
            None => WireEvent::Error(RuntimeError::Internal("engine dropped the request".into())),
            Some(ev) => match WireEvent::from_engine(ev) {
                Some(w) => w,
                None => continue,
            },
        };
        let last = wire_ev.is_last();
        if tx
            .write_frame(wr, Kind::Event, &wire_ev, &[])
            .await
            .is_err()
            || last
        {
            return;
        }
    }
}

async fn receive(
    rd: &mut BufReader<OwnedReadHalf>,
    wr: &mut OwnedWriteHalf,
    (tx, rx): (&mut FrameWriter, &mut FrameReader),
    node: &Node,
    cfg: &TransferConfig,
    accepted: &mut bool,
) -> Result<Submission, Failure> {
    let before = |error: RuntimeError| Failure {
        accepted: false,
        error,
    };
    // Only a peer holding the cluster's key can write this Hello, and only for this
    // connection: the tenant below is the authenticated one.
    let hello = wire::read_hello(rd, tx, rx, cfg.max_frame_bytes)
        .await
        .map_err(before)?;
    let engine = node
        .text_engine(&hello.model)
        .ok_or_else(|| before(RuntimeError::UnknownModel(hello.model.clone())))?;
    let mut guard = admit(&engine, &hello).await.map_err(before)?;
    tx.write_empty(wr, Kind::Accept)
        .await
        .map_err(|e| before(TransferError::PeerClosed(e.to_string()).into()))?;
    *accepted = true;
    let after = |error: RuntimeError| Failure {
        accepted: true,
        error,
    };
    let logits = receive_pages(rd, rx, &engine, &hello, &mut guard, cfg, node)
        .await
        .map_err(after)?;
    let kv = guard.take();
    engine
        .submit_transferred(hello.prompt, hello.params, kv, logits, hello.cached_tokens)
        .map_err(after)
}

/// Check the handshake and reserve room for the whole generation in this node's pool.
async fn admit(engine: &Engine, hello: &Hello) -> Result<KvGuard, RuntimeError> {
    let pool = engine.pool();
    let layout = pool.layout();
    if hello.version != wire::PROTOCOL_VERSION {
        return Err(TransferError::Protocol(format!(
            "protocol version {} (this node speaks {})",
            hello.version,
            wire::PROTOCOL_VERSION
        ))
        .into());
    }
    if hello.layers != layout.layers
        || hello.kv_dim != layout.kv_dim
        || hello.page_size != pool.page_size()
        || hello.dtype != wire::DTYPE
    {
        return Err(TransferError::Layout(format!(
            "sent {} layers x {} dims, pages of {}, {}; this node has {} x {}, pages of {}, {}",
            hello.layers,
            hello.kv_dim,
            hello.page_size,
            hello.dtype,
            layout.layers,
            layout.kv_dim,
            pool.page_size(),
            wire::DTYPE
        ))
        .into());
    }
    // The incident's placeholder: a declared length that is not the prompt's.
    if hello.token_count != hello.prompt.len() {
        return Err(TransferError::PromptLength {
            declared: hello.token_count,
            prompt: hello.prompt.len(),
        }
        .into());
    }
    if hello.page_count != pool.pages_for(hello.token_count) {
        return Err(TransferError::PageCount {
            declared: hello.page_count,
            received: pool.pages_for(hello.token_count),
        }
        .into());
    }
    hello.params.validate()?;
    // The same admission as a unified node, against this node's window and pool.
    check_generation(
        hello.prompt.len(),
        hello.params.max_tokens,
        engine.model().context_window,
        pool.capacity_tokens(),
    )?;
    // Cannot overflow: `check_generation` bounded the sum by the window.
    let need = hello.prompt.len() + hello.params.max_tokens;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(engine.queue_timeout_ms());
    let reservation =
        pool.reserve_by(need, deadline)
            .await
            .map_err(|full| RuntimeError::Overloaded {
                reason: format!("decode node KV pool full: {full}"),
                retry_after_s: 1,
            })?;
    let owner = engine.new_owner(&hello.tenant);
    let mut guard = KvGuard {
        pool: pool.clone(),
        kv: Some(pool.open(owner, reservation)),
    };
    pool.grow(guard.seq(), hello.token_count)?;
    Ok(guard)
}

/// Receive one full page straight into page `index` of `seq`: first what the buffered
/// reader already holds, then from the socket with non-blocking reads, each under the page's
/// lock and owner check (never held across an await). Each read is fed to the frame's tail
/// MAC right after it, as it lies in the pool and while it is still in cache.
async fn read_full_page(
    rd: &mut BufReader<OwnedReadHalf>,
    mac: &mut FrameHead,
    pool: &KvPool,
    seq: &SeqKv,
    index: usize,
) -> Result<(), RuntimeError> {
    let closed = |e: std::io::Error| RuntimeError::from(TransferError::PeerClosed(e.to_string()));
    let len = pool.wire_bytes(pool.page_size());
    let buffered = rd.buffer().len().min(len);
    pool.with_full_page_mut(seq, index, |page| {
        page[..buffered].copy_from_slice(&rd.buffer()[..buffered]);
        mac.update(&page[..buffered]);
    })?;
    rd.consume(buffered);
    let mut got = buffered;
    while got < len {
        let socket = rd.get_ref();
        let read = pool.with_full_page_mut(seq, index, |page| {
            let read = socket.try_read(&mut page[got..]);
            if let Ok(n) = read {
                mac.update(&page[got..got + n]);
            }
            read
        })?;
        match read {
            Ok(0) => return Err(TransferError::PeerClosed("connection closed".into()).into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                socket.readable().await.map_err(closed)?
            }
            Err(e) => return Err(closed(e)),
        }
    }
    Ok(())
}

/// Receive every batch and the commit; verify all of it. Returns the logits.
async fn receive_pages(
    rd: &mut BufReader<OwnedReadHalf>,
    rx: &mut FrameReader,
    engine: &Engine,
    hello: &Hello,
    guard: &mut KvGuard,
    cfg: &TransferConfig,
    node: &Node,
) -> Result<Vec<f32>, RuntimeError> {
    let pool = engine.pool().clone();
    let page_size = pool.page_size();
    let mut got = vec![false; hello.page_count];
    let mut partial = Vec::new();
    let mut tokens = 0usize;
    let mut bytes = 0u64;
    let protocol = |m: String| RuntimeError::from(TransferError::Protocol(m));
    let (commit, tail) = loop {
        let mut head = rx.read_head(rd, cfg.max_frame_bytes).await?;
        if head.kind != Kind::Pages {
            match head.read_rest(rd).await? {
                Frame::Commit(c, tail) => break (c, tail),
                f => return Err(protocol(format!("unexpected {} frame", f.kind()))),
            }
        }
        let header: wire::PagesHeader = head.parse()?;
        if header.tenant != hello.tenant || header.request != hello.request {
            return Err(TransferError::Owner {
                index: header.pages.first().map_or(0, |p| p.index),
            }
            .into());
        }
        // Check every page header, and that they account for the whole tail, before
        // reading any page data.
        let mut expected_tail = 0usize;
        for p in &header.pages {
            let index = p.index as usize;
            if index >= hello.page_count || got[index] {
                return Err(protocol(format!("page {index} out of place")));
            }
            // Every page is full except the last; nothing may leave a hole.
            let expected = page_size.min(hello.token_count - index * page_size);
            if p.tokens as usize != expected {
                return Err(TransferError::TokenCount {
                    declared: expected,
                    received: p.tokens as usize,
                }
                .into());
            }
            got[index] = true;
            expected_tail += pool.wire_bytes(expected);
        }
        if expected_tail != head.tail_len {
            return Err(protocol(format!(
                "a batch of {} page bytes carries {} bytes",
                expected_tail, head.tail_len
            )));
        }
        for p in &header.pages {
            let (index, in_page) = (p.index as usize, p.tokens as usize);
            // Written into this sequence's own page and MAC'd there; nothing reads the
            // page unless the whole transfer verifies.
            if in_page == page_size {
                read_full_page(rd, &mut head, &pool, guard.seq(), index).await?;
            } else {
                partial.resize(pool.wire_bytes(in_page), 0);
                rd.read_exact(&mut partial)
                    .await
                    .map_err(|e| TransferError::PeerClosed(e.to_string()))?;
                head.update(&partial);
                pool.import_page(guard.seq(), index, in_page, &partial)?;
            }
            tokens += in_page;
        }
        bytes += head.tail_len as u64;
        // The batch's bytes are authentic only now; a failure releases the guard's pages.
        head.check_tail(rd).await?;
    };
    node.metrics
        .transfer_bytes
        .get_or_create(&side(super::RECEIVE))
        .inc_by(bytes);
    if commit.token_count != hello.token_count || tokens != hello.token_count {
        return Err(TransferError::TokenCount {
            declared: hello.token_count,
            received: tokens.min(commit.token_count),
        }
        .into());
    }
    let pages = got.iter().filter(|g| **g).count();
    if commit.page_count != hello.page_count || pages != hello.page_count {
        return Err(TransferError::PageCount {
            declared: hello.page_count,
            received: pages,
        }
        .into());
    }
    if commit.bytes != bytes {
        return Err(protocol(format!(
            "commit counts {} bytes, {bytes} arrived",
            commit.bytes
        )));
    }
    let vocab = engine.model().decoder.cfg.vocab_size;
    if tail.len() != vocab * 4 {
        return Err(protocol(format!(
            "{} bytes of logits for a vocabulary of {vocab}",
            tail.len()
        )));
    }
    let logits = tail
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    pool.commit(guard.seq(), hello.token_count);
    Ok(logits)
}
