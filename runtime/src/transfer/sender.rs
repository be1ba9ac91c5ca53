//! The prefill side of a KV transfer: ship a `PrefillHandoff` to a decode node, then relay
//! the decode node's generation events to the client.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::TransferConfig;
use super::wire::{
    self, Commit, Frame, FrameReader, FrameWriter, Hello, Kind, PageHeader, PagesHeader, TailMac,
    WireEvent,
};
use crate::engine::{GenEvent, PrefillHandoff};
use crate::error::{RuntimeError, TransferError};
use crate::kv::{KvPool, Owner, PageRef};
use crate::metrics::{NodeMetrics, side};

/// The decode nodes a prefill node sends to, taken in turn.
pub struct DecodePeers {
    addrs: Vec<String>,
    next: AtomicUsize,
}

impl DecodePeers {
    pub fn new(addrs: Vec<String>) -> Self {
        DecodePeers {
            addrs,
            next: AtomicUsize::new(0),
        }
    }

    /// Every peer once, starting with the next in turn.
    fn rotation(&self) -> Vec<&str> {
        let n = self.addrs.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|i| self.addrs[(start + i) % n].as_str())
            .collect()
    }
}

/// A connection to a decode node that acknowledged a transfer.
pub struct Accepted {
    reader: BufReader<OwnedReadHalf>,
    /// The rest of decode's frames are authenticated against this connection's state.
    frames: FrameReader,
    // Kept so the connection stays open; dropping it tells decode to cancel.
    _writer: OwnedWriteHalf,
}

/// Turn a prefill-only request's events into the events of the whole generation: wait for
/// the engine's `Prefilled`, transfer it to a decode node, and relay what decode generates.
/// A client that leaves before the handoff cancels the prefill; once a transfer starts it
/// runs to its acknowledgement or rollback, and only then is decoding cancelled.
pub fn disaggregate(
    mut events: UnboundedReceiver<GenEvent>,
    model: String,
    peers: Arc<DecodePeers>,
    cfg: TransferConfig,
    metrics: Arc<NodeMetrics>,
) -> UnboundedReceiver<GenEvent> {
    let (out, rx) = unbounded_channel();
    tokio::spawn(async move {
        let handoff = loop {
            let ev = tokio::select! {
                ev = events.recv() => ev,
                // Dropping `events` tells the engine to stop prefilling.
                _ = out.closed() => return,
            };
            match ev {
                None => {
                    let _ = out.send(GenEvent::Error(RuntimeError::Internal(
                        "engine dropped the request".into(),
                    )));
                    return;
                }
                Some(GenEvent::Prefilled(h)) => break h,
                Some(ev @ (GenEvent::Done { .. } | GenEvent::Error(_))) => {
                    let _ = out.send(ev);
                    return;
                }
                Some(ev) => {
                    let _ = out.send(ev);
                }
            }
        };
        drop(events);
        let result = send_to_peers(&handoff, &model, &peers, &cfg, &metrics).await;
        // Acknowledged, refused or timed out: this node's pages go back to its pool now.
        drop(handoff);
        match result {
            Ok(accepted) => relay(accepted, out, cfg.max_frame_bytes).await,
            Err(e) => {
                let _ = out.send(GenEvent::Error(e));
            }
        }
    });
    rx
}

/// Try each peer in turn while the failure means the request was never accepted there.
async fn send_to_peers(
    handoff: &PrefillHandoff,
    model: &str,
    peers: &DecodePeers,
    cfg: &TransferConfig,
    metrics: &NodeMetrics,
) -> Result<Accepted, RuntimeError> {
    let mut last = RuntimeError::Transfer(TransferError::NoPeer);
    for peer in peers.rotation() {
        match send(handoff, model, peer, cfg, metrics).await {
            Ok(a) => return Ok(a),
            Err(e @ RuntimeError::Transfer(TransferError::Connect { .. }))
            | Err(e @ RuntimeError::Overloaded { .. }) => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// One transfer to `peer`, bounded by the lease, counted in the metrics.
pub async fn send(
    handoff: &PrefillHandoff,
    model: &str,
    peer: &str,
    cfg: &TransferConfig,
    metrics: &NodeMetrics,
) -> Result<Accepted, RuntimeError> {
    metrics
        .transfers_started
        .get_or_create(&side(super::SEND))
        .inc();
    let lease = Duration::from_millis(cfg.lease_ms);
    let started = std::time::Instant::now();
    let result =
        match tokio::time::timeout(lease, send_inner(handoff, model, peer, cfg, metrics)).await {
            Ok(r) => r,
            Err(_) => Err(TransferError::LeaseExpired {
                lease_ms: cfg.lease_ms,
            }
            .into()),
        };
    match &result {
        Ok(_) => {
            metrics
                .transfers_committed
                .get_or_create(&side(super::SEND))
                .inc();
            metrics
                .transfer_seconds
                .get_or_create(&side(super::SEND))
                .observe(started.elapsed().as_secs_f64());
        }
        Err(e) => {
            tracing::warn!(
                peer,
                request = handoff.owner.request,
                "KV transfer failed: {e}"
            );
            metrics.transfer_failed(super::SEND, e);
        }
    }
    result
}

async fn send_inner(
    h: &PrefillHandoff,
    model: &str,
    peer: &str,
    cfg: &TransferConfig,
    metrics: &NodeMetrics,
) -> Result<Accepted, RuntimeError> {
    let key = cfg.require_key()?;
    let stream = TcpStream::connect(peer)
        .await
        .map_err(|e| TransferError::Connect {
            peer: peer.into(),
            detail: e.to_string(),
        })?;
    let _ = stream.set_nodelay(true);
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::new(rd);
    let pool = h.pool();
    let page_size = pool.page_size();
    let tokens = h.prompt.len();
    let layout = pool.layout();
    let mut hello = Hello {
        version: wire::PROTOCOL_VERSION,
        nonce: [0; wire::NONCE_LEN],
        request: h.owner.request,
        tenant: h.owner.tenant.to_string(),
        model: model.to_string(),
        prompt: h.prompt.clone(),
        token_count: tokens,
        page_count: h.pages.len(),
        page_size,
        layers: layout.layers,
        kv_dim: layout.kv_dim,
        dtype: wire::DTYPE.into(),
        params: h.params.clone(),
        cached_tokens: h.cached_tokens,
    };
    // Decode speaks first (its challenge); only a peer holding the cluster's key gets the
    // Hello, and with it the tenant's prompt.
    let (mut tx, mut rx) =
        wire::write_hello(&mut rd, &mut wr, key, &mut hello, cfg.max_frame_bytes).await?;
    match rx.read_frame(&mut rd, cfg.max_frame_bytes).await? {
        Frame::Accept => {}
        Frame::Reject(e) => return Err(e),
        f => return Err(unexpected(&f)),
    }
    match stream_pages(h, &mut wr, &mut tx, cfg, metrics).await {
        Ok(()) => {}
        // A decode node that refuses the transfer midway (a failed MAC, say) says why and
        // closes; the write that found it closed is not the reason, its answer is.
        Err(e @ RuntimeError::Transfer(TransferError::PeerClosed(_))) => {
            return Err(refusal(&mut rd, &mut rx, cfg).await.unwrap_or(e));
        }
        Err(e) => return Err(e),
    }
    match rx.read_frame(&mut rd, cfg.max_frame_bytes).await? {
        Frame::Ack => Ok(Accepted {
            reader: rd,
            frames: rx,
            _writer: wr,
        }),
        Frame::Nack(e) => Err(e),
        f => Err(unexpected(&f)),
    }
}

/// The pages, then the commit with the logits. Batches bounded by bytes (at least one page
/// each): TCP flow control makes a slow decode node slow us down. Full pages go to the
/// socket straight from the pool, with non-blocking writes under the page's lock (never held
/// across an await), each written run MAC'd right after the kernel copied it (still in
/// cache); only a partial last page is copied out first.
async fn stream_pages(
    h: &PrefillHandoff,
    wr: &mut OwnedWriteHalf,
    tx: &mut FrameWriter,
    cfg: &TransferConfig,
    metrics: &NodeMetrics,
) -> Result<(), RuntimeError> {
    let io = |e: std::io::Error| RuntimeError::from(TransferError::PeerClosed(e.to_string()));
    let pool = h.pool();
    let page_size = pool.page_size();
    let tokens = h.prompt.len();
    let page_bytes = pool.wire_bytes(page_size);
    let per_batch = (cfg.batch_bytes / page_bytes).max(1);
    let mut partial = Vec::new();
    let mut sent = 0u64;
    let mut first = 0;
    while first < h.pages.len() {
        let last = (first + per_batch).min(h.pages.len());
        let mut headers = Vec::with_capacity(last - first);
        let mut tail_len = 0;
        for (i, page) in h.pages.iter().enumerate().take(last).skip(first) {
            let in_page = page_size.min(tokens - i * page_size);
            if in_page < page_size {
                partial.clear();
                pool.export_page(&h.owner, *page, in_page, &mut partial)?;
            }
            tail_len += pool.wire_bytes(in_page);
            headers.push(PageHeader {
                index: i as u32,
                tokens: in_page as u32,
            });
        }
        let header = PagesHeader {
            tenant: h.owner.tenant.to_string(),
            request: h.owner.request,
            pages: headers,
        };
        let mut mac = tx
            .write_head(wr, Kind::Pages, &header, tail_len)
            .await
            .map_err(io)?;
        for (p, page) in header.pages.iter().zip(&h.pages[first..last]) {
            if p.tokens as usize == page_size {
                write_full_page(wr, &mut mac, pool, &h.owner, *page, page_bytes).await?;
            } else {
                wr.write_all(&partial).await.map_err(io)?;
                mac.update(&partial);
            }
        }
        mac.finish(wr).await.map_err(io)?;
        sent += tail_len as u64;
        first = last;
    }
    metrics
        .transfer_bytes
        .get_or_create(&side(super::SEND))
        .inc_by(sent);
    let logits: &[u8] = bytemuck::cast_slice(&h.logits);
    let commit = Commit {
        token_count: tokens,
        page_count: h.pages.len(),
        bytes: sent,
    };
    tx.write_frame(wr, Kind::Commit, &commit, logits)
        .await
        .map_err(io)?;
    Ok(())
}

/// How long a sender whose write found the connection closed waits for the peer's reason.
const REFUSAL_WAIT: Duration = Duration::from_millis(500);

/// The refusal a peer sent before closing, if one arrives within [`REFUSAL_WAIT`].
async fn refusal(
    rd: &mut BufReader<OwnedReadHalf>,
    rx: &mut FrameReader,
    cfg: &TransferConfig,
) -> Option<RuntimeError> {
    let frame = tokio::time::timeout(REFUSAL_WAIT, rx.read_frame(rd, cfg.max_frame_bytes));
    match frame.await {
        Ok(Ok(Frame::Nack(e) | Frame::Reject(e))) => Some(e),
        _ => None,
    }
}

/// Send a full page straight from the pool: each non-blocking write runs under the page's
/// read lock and owner check, and MACs what it wrote; waiting for the socket happens with
/// the lock released.
async fn write_full_page(
    wr: &OwnedWriteHalf,
    mac: &mut TailMac,
    pool: &KvPool,
    owner: &Owner,
    page: PageRef,
    len: usize,
) -> Result<(), RuntimeError> {
    let io = |e: std::io::Error| RuntimeError::from(TransferError::PeerClosed(e.to_string()));
    let mut sent = 0;
    while sent < len {
        let written = pool.with_full_page(owner, page, |bytes| {
            let n = wr.try_write(&bytes[sent..]);
            if let Ok(n) = n {
                mac.update(&bytes[sent..sent + n]);
            }
            n
        })?;
        match written {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wr.writable().await.map_err(io)?
            }
            Err(e) => return Err(io(e)),
        }
    }
    Ok(())
}

fn unexpected(f: &Frame) -> RuntimeError {
    TransferError::Protocol(format!("unexpected {} frame", f.kind())).into()
}

/// Relay decode's events to the client until the generation ends. A client that leaves
/// closes the connection, which cancels the generation on the decode node.
async fn relay(mut conn: Accepted, out: UnboundedSender<GenEvent>, max_frame: usize) {
    loop {
        let frame = tokio::select! {
            f = conn.frames.read_frame(&mut conn.reader, max_frame) => f,
            _ = out.closed() => return,
        };
        let ev = match frame {
            Ok(Frame::Event(ev)) => ev,
            Err(e) => WireEvent::Error(e),
            Ok(f) => WireEvent::Error(unexpected(&f)),
        };
        let last = ev.is_last();
        if out.send(ev.into()).is_err() || last {
            return;
        }
    }
}
