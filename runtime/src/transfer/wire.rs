//! The KV transfer wire format: length-prefixed, authenticated frames over one TCP connection
//! per request.
//!
//! A frame is `[u32 body length][u8 kind][u32 header length][JSON header][head MAC][binary
//! tail][tail MAC]`, integers little-endian, MACs 32 bytes; a frame without a tail has no tail
//! MAC. Control frames carry only the JSON header; `Pages` carries the page data of a batch as
//! its tail and `Commit` the last position's logits. JSON keeps the control messages readable
//! in a capture; the bulk bytes are never encoded.
//!
//! Decode opens with `Challenge` (a fresh nonce). Prefill sends `Hello` (with a fresh nonce of
//! its own), waits for `Accept` or `Reject`, sends `Pages`* then `Commit`, and waits for `Ack`
//! or `Nack`. After `Ack` the decode node sends `Event`s until the generation ends; either
//! side closing the connection ends the request.
//!
//! Every frame's MACs are keyed BLAKE3 under the cluster's transfer key (derived,
//! `TransferKey::mac_key`) over: both nonces (each zero until the frame that carries it has
//! gone by; that frame covers it in its header), the direction, the frame's sequence number
//! in its direction, its kind, header and tail lengths and the header; the tail MAC goes on
//! over the tail. So a frame is only valid at its one place in its one connection: a
//! changed byte, a reordered, dropped or inserted frame, a frame of another transfer, a frame
//! reflected back, and a replayed connection (decode's nonce differs) all fail. The head MAC
//! is checked before a header is acted on; the tail MAC as the tail is read into the pool,
//! before anything is committed.

use bytes::{BufMut, Bytes};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::TransferKey;
use crate::engine::{FinishReason, GenEvent, Usage};
use crate::error::{RuntimeError, TransferError};
use crate::sampling::SamplingParams;

/// Bumped on any incompatible change; a decode node refuses other versions.
pub const PROTOCOL_VERSION: u32 = 2;

/// Element type of the K/V on the wire: f32, little-endian (the pool's own layout).
pub const DTYPE: &str = "f32le";

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a MAC.
pub const MAC_LEN: usize = 32;

/// A connection's random challenge (decode's) or prefill's answer to it.
pub type Nonce = [u8; NONCE_LEN];

/// A fresh nonce from the thread's CSPRNG.
pub fn fresh_nonce() -> Nonce {
    rand::random()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Accept = 2,
    Reject = 3,
    Pages = 4,
    Commit = 5,
    Ack = 6,
    Nack = 7,
    Event = 8,
    Challenge = 9,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Accept,
            3 => Kind::Reject,
            4 => Kind::Pages,
            5 => Kind::Commit,
            6 => Kind::Ack,
            7 => Kind::Nack,
            8 => Kind::Event,
            9 => Kind::Challenge,
            _ => return None,
        })
    }
}

/// Nonces as hex in JSON headers.
mod hex_nonce {
    use super::*;

    pub fn serialize<S: Serializer>(n: &Nonce, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex::encode(n))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Nonce, D::Error> {
        let text = String::deserialize(d)?;
        let mut n = [0u8; NONCE_LEN];
        hex::decode_to_slice(&text, &mut n).map_err(serde::de::Error::custom)?;
        Ok(n)
    }
}

/// Decode's first frame: the nonce every later frame of the connection is bound to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Challenge {
    pub version: u32,
    #[serde(with = "hex_nonce")]
    pub nonce: Nonce,
}

/// The handshake: who the request is, what its prompt is, and what will be sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    /// Prefill's fresh nonce: decode's answers are bound to it, so a recorded decode
    /// connection cannot be played back to a prefill node. Set by [`write_hello`].
    #[serde(with = "hex_nonce")]
    pub nonce: Nonce,
    /// The prefill node's request number; with `tenant`, the owner every page must carry.
    pub request: u64,
    pub tenant: String,
    pub model: String,
    /// The prompt's token ids (decode needs them for repetition penalties and usage).
    pub prompt: Vec<u32>,
    /// Tokens of KV that will be sent: must equal `prompt.len()`.
    pub token_count: usize,
    pub page_count: usize,
    pub page_size: usize,
    pub layers: usize,
    pub kv_dim: usize,
    pub dtype: String,
    pub params: SamplingParams,
    /// Prompt tokens the prefill node took from its prefix cache: usage reports them.
    #[serde(default)]
    pub cached_tokens: usize,
}

/// One page of a batch; its bytes follow in the frame's tail, in header order. No per-page
/// checksum: the batch's tail MAC covers the same bytes (on decode, as they lie in its pool
/// after each read, as the xxh3 of v1 did), and unlike a checksum it cannot be recomputed by
/// whoever changed them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageHeader {
    /// Position of the page in the sequence's block table.
    pub index: u32,
    /// Tokens of KV in the page (a full page except possibly the last).
    pub tokens: u32,
}

/// A batch of pages, with the owner the sender's pool tagged them with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagesHeader {
    pub tenant: String,
    pub request: u64,
    pub pages: Vec<PageHeader>,
}

/// The totals the receiver checks everything against; the logits are the tail (covered by
/// the frame's tail MAC).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Commit {
    pub token_count: usize,
    pub page_count: usize,
    /// Page bytes sent in all batches.
    pub bytes: u64,
}

/// An error answer (`Reject` before pages, `Nack` after the commit or a failed check).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorFrame {
    pub error: RuntimeError,
}

/// A generation event from the decode node, after `Ack`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireEvent {
    Token {
        text: String,
    },
    Done {
        usage: Usage,
        finish_reason: FinishReason,
    },
    Error(RuntimeError),
}

impl WireEvent {
    /// The wire form of an engine event a decode node streams back. `Admitted` stays on the
    /// node (`None`); a `Prefilled` cannot happen on a decode node and goes out as an error.
    pub fn from_engine(ev: GenEvent) -> Option<WireEvent> {
        Some(match ev {
            GenEvent::Admitted { .. } => return None,
            GenEvent::Token { text } => WireEvent::Token { text },
            GenEvent::Done {
                usage,
                finish_reason,
            } => WireEvent::Done {
                usage,
                finish_reason,
            },
            GenEvent::Error(e) => WireEvent::Error(e),
            GenEvent::Prefilled(_) => WireEvent::Error(RuntimeError::Internal(
                "a decode node does not hand off".into(),
            )),
        })
    }

    /// Whether this event ends the generation.
    pub fn is_last(&self) -> bool {
        !matches!(self, WireEvent::Token { .. })
    }
}

impl From<WireEvent> for GenEvent {
    fn from(ev: WireEvent) -> GenEvent {
        match ev {
            WireEvent::Token { text } => GenEvent::Token { text },
            WireEvent::Done {
                usage,
                finish_reason,
            } => GenEvent::Done {
                usage,
                finish_reason,
            },
            WireEvent::Error(e) => GenEvent::Error(e),
        }
    }
}

/// A decoded frame.
#[derive(Debug)]
pub enum Frame {
    Challenge(Challenge),
    Hello(Box<Hello>),
    Accept,
    Reject(RuntimeError),
    Pages(PagesHeader, Bytes),
    Commit(Commit, Bytes),
    Ack,
    Nack(RuntimeError),
    Event(WireEvent),
}

impl Frame {
    pub fn kind(&self) -> &'static str {
        match self {
            Frame::Challenge(_) => "challenge",
            Frame::Hello(_) => "hello",
            Frame::Accept => "accept",
            Frame::Reject(_) => "reject",
            Frame::Pages(..) => "pages",
            Frame::Commit(..) => "commit",
            Frame::Ack => "ack",
            Frame::Nack(_) => "nack",
            Frame::Event(_) => "event",
        }
    }
}

fn kind_name(kind: u8) -> &'static str {
    match Kind::from_u8(kind) {
        Some(Kind::Challenge) => "challenge",
        Some(Kind::Hello) => "hello",
        Some(Kind::Accept) => "accept",
        Some(Kind::Reject) => "reject",
        Some(Kind::Pages) => "pages",
        Some(Kind::Commit) => "commit",
        Some(Kind::Ack) => "ack",
        Some(Kind::Nack) => "nack",
        Some(Kind::Event) => "event",
        None => "unknown",
    }
}

fn protocol(msg: impl Into<String>) -> RuntimeError {
    TransferError::Protocol(msg.into()).into()
}

fn parse<T: serde::de::DeserializeOwned>(json: &[u8]) -> Result<T, RuntimeError> {
    serde_json::from_slice(json).map_err(|e| protocol(format!("bad header: {e}")))
}

fn closed(e: std::io::Error) -> RuntimeError {
    TransferError::PeerClosed(e.to_string()).into()
}

/// Which way a frame travels; in every MAC, so a frame cannot be reflected to its sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Direction {
    ToDecode = 1,
    ToPrefill = 2,
}

/// The MAC state of one direction of one connection.
#[cfg_attr(test, derive(Clone))]
struct MacStream {
    key: [u8; 32],
    /// Decode's nonce, then prefill's; each zero until the frame that carries it is past.
    nonces: [u8; 2 * NONCE_LEN],
    direction: Direction,
    /// The next frame's sequence number in this direction.
    seq: u64,
}

impl MacStream {
    fn new(key: &TransferKey, direction: Direction) -> Self {
        MacStream {
            key: key.mac_key(),
            nonces: [0; 2 * NONCE_LEN],
            direction,
            seq: 0,
        }
    }

    fn bind_decode(&mut self, nonce: &Nonce) {
        self.nonces[..NONCE_LEN].copy_from_slice(nonce);
    }

    fn bind_prefill(&mut self, nonce: &Nonce) {
        self.nonces[NONCE_LEN..].copy_from_slice(nonce);
    }

    /// The MAC of the next frame up to its header; the tail, if any, goes on from here.
    fn start(&mut self, kind: u8, json: &[u8], tail_len: usize) -> blake3::Hasher {
        let mut h = blake3::Hasher::new_keyed(&self.key);
        h.update(&self.nonces);
        h.update(&[self.direction as u8]);
        h.update(&self.seq.to_le_bytes());
        h.update(&[kind]);
        h.update(&(json.len() as u64).to_le_bytes());
        h.update(&(tail_len as u64).to_le_bytes());
        h.update(json);
        self.seq += 1;
        h
    }
}

/// Writes this side's frames, each with its MACs.
pub struct FrameWriter {
    mac: MacStream,
}

// Debug shows the position only: the MAC state is derived from the cluster's key.
impl std::fmt::Debug for FrameWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameWriter")
            .field("seq", &self.mac.seq)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for FrameReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameReader")
            .field("seq", &self.mac.seq)
            .finish_non_exhaustive()
    }
}

/// The MAC of a frame's tail, fed the tail's bytes as they are written (the sender writes
/// pages straight from its pool, so this sees them there, with no copy of its own).
pub struct TailMac {
    hasher: blake3::Hasher,
    left: usize,
    has_tail: bool,
}

impl TailMac {
    pub fn update(&mut self, bytes: &[u8]) {
        debug_assert!(bytes.len() <= self.left, "more tail than the head declared");
        self.left = self.left.saturating_sub(bytes.len());
        self.hasher.update(bytes);
    }

    /// After exactly the declared tail went through [`TailMac::update`] and out: the MAC.
    pub async fn finish<W: AsyncWrite + Unpin>(self, w: &mut W) -> std::io::Result<()> {
        if self.left != 0 {
            return Err(std::io::Error::other(format!(
                "frame tail {} bytes short of its header",
                self.left
            )));
        }
        if self.has_tail {
            w.write_all(self.hasher.finalize().as_bytes()).await?;
        }
        Ok(())
    }
}

impl FrameWriter {
    /// Write a frame's length, kind, JSON header and head MAC; the caller then writes exactly
    /// `tail_len` bytes of tail, passing each through the returned [`TailMac`], and finishes.
    pub async fn write_head<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        kind: Kind,
        header: &impl Serialize,
        tail_len: usize,
    ) -> std::io::Result<TailMac> {
        let json = serde_json::to_vec(header).map_err(std::io::Error::other)?;
        let tail_mac = if tail_len > 0 { MAC_LEN } else { 0 };
        let body_len = 1 + 4 + json.len() + MAC_LEN + tail_len + tail_mac;
        let body_len = u32::try_from(body_len).map_err(|_| {
            std::io::Error::other(format!("frame of {body_len} bytes is too large"))
        })?;
        let hasher = self.mac.start(kind as u8, &json, tail_len);
        let mut head = Vec::with_capacity(9 + json.len() + MAC_LEN);
        head.extend_from_slice(&body_len.to_le_bytes());
        head.push(kind as u8);
        head.extend_from_slice(&(json.len() as u32).to_le_bytes());
        head.extend_from_slice(&json);
        head.extend_from_slice(hasher.finalize().as_bytes());
        w.write_all(&head).await?;
        Ok(TailMac {
            hasher,
            left: tail_len,
            has_tail: tail_len > 0,
        })
    }

    /// Write one frame: a JSON header and an optional binary tail.
    pub async fn write_frame<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        kind: Kind,
        header: &impl Serialize,
        tail: &[u8],
    ) -> std::io::Result<()> {
        let mut mac = self.write_head(w, kind, header, tail.len()).await?;
        if !tail.is_empty() {
            w.write_all(tail).await?;
            mac.update(tail);
        }
        mac.finish(w).await
    }

    /// Write a frame with no header fields.
    pub async fn write_empty<W: AsyncWrite + Unpin>(
        &mut self,
        w: &mut W,
        kind: Kind,
    ) -> std::io::Result<()> {
        self.write_frame(w, kind, &serde_json::json!({}), &[]).await
    }
}

/// Reads and authenticates the peer's frames.
#[cfg_attr(test, derive(Clone))]
pub struct FrameReader {
    mac: MacStream,
}

/// A frame's kind and JSON header, read and authenticated; its tail (`tail_len` bytes) and
/// the tail's MAC are still on the wire.
pub struct FrameHead {
    pub kind: Kind,
    json: Vec<u8>,
    pub tail_len: usize,
    mac: blake3::Hasher,
    seen: usize,
}

impl std::fmt::Debug for FrameHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameHead")
            .field("kind", &self.kind)
            .field("tail_len", &self.tail_len)
            .finish_non_exhaustive()
    }
}

async fn read_mac<R: AsyncRead + Unpin>(r: &mut R) -> Result<blake3::Hash, RuntimeError> {
    let mut mac = [0u8; MAC_LEN];
    r.read_exact(&mut mac).await.map_err(closed)?;
    Ok(blake3::Hash::from_bytes(mac))
}

impl FrameHead {
    /// The JSON header as `T`, or a protocol error.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, RuntimeError> {
        parse(&self.json)
    }

    /// Feed tail bytes to the tail MAC, in order, as they are read.
    pub fn update(&mut self, bytes: &[u8]) {
        self.seen += bytes.len();
        self.mac.update(bytes);
    }

    /// After the whole tail went through [`FrameHead::update`]: read and check its MAC.
    pub async fn check_tail<R: AsyncRead + Unpin>(self, r: &mut R) -> Result<(), RuntimeError> {
        if self.seen != self.tail_len {
            return Err(RuntimeError::Internal(format!(
                "{} of {} tail bytes authenticated",
                self.seen, self.tail_len
            )));
        }
        if self.tail_len == 0 {
            return Ok(());
        }
        // `blake3::Hash` compares in constant time.
        if read_mac(r).await? != self.mac.finalize() {
            return Err(TransferError::Mac {
                frame: kind_name(self.kind as u8).into(),
            }
            .into());
        }
        Ok(())
    }

    /// Read and authenticate the tail, and decode the whole frame.
    pub async fn read_rest<R: AsyncRead + Unpin>(
        mut self,
        r: &mut R,
    ) -> Result<Frame, RuntimeError> {
        // Read into uninitialised capacity: zeroing megabytes per batch costs a pass over them.
        let mut tail = bytes::BytesMut::with_capacity(self.tail_len);
        while tail.len() < self.tail_len {
            let left = self.tail_len - tail.len();
            let mut limited = (&mut tail).limit(left);
            match r.read_buf(&mut limited).await {
                Ok(0) => return Err(TransferError::PeerClosed("connection closed".into()).into()),
                Ok(_) => {}
                Err(e) => return Err(closed(e)),
            }
        }
        let tail = tail.freeze();
        self.update(&tail);
        let kind = self.kind;
        let json = std::mem::take(&mut self.json);
        self.check_tail(r).await?;
        let no_tail = |f: Frame| {
            if tail.is_empty() {
                Ok(f)
            } else {
                Err(protocol(format!("{} frame with a tail", f.kind())))
            }
        };
        match kind {
            Kind::Challenge => no_tail(Frame::Challenge(parse(&json)?)),
            Kind::Hello => no_tail(Frame::Hello(Box::new(parse(&json)?))),
            Kind::Accept => no_tail(Frame::Accept),
            Kind::Reject => no_tail(Frame::Reject(parse::<ErrorFrame>(&json)?.error)),
            Kind::Pages => Ok(Frame::Pages(parse(&json)?, tail)),
            Kind::Commit => Ok(Frame::Commit(parse(&json)?, tail)),
            Kind::Ack => no_tail(Frame::Ack),
            Kind::Nack => no_tail(Frame::Nack(parse::<ErrorFrame>(&json)?.error)),
            Kind::Event => no_tail(Frame::Event(parse(&json)?)),
        }
    }
}

impl FrameReader {
    /// Read a frame's length, kind, JSON header and head MAC, for a body of at most
    /// `max_body` bytes; only an authentic header is returned. A closed connection is
    /// `PeerClosed`; a failed MAC is `Unauthenticated` on the peer's first frame (it does not
    /// hold the key) and `Mac` after it; anything else malformed is a protocol error.
    pub async fn read_head<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max_body: usize,
    ) -> Result<FrameHead, RuntimeError> {
        let mut fixed = [0u8; 9];
        r.read_exact(&mut fixed).await.map_err(closed)?;
        let body_len = u32::from_le_bytes(fixed[0..4].try_into().expect("4 bytes")) as usize;
        let json_len = u32::from_le_bytes(fixed[5..9].try_into().expect("4 bytes")) as usize;
        if body_len > max_body {
            return Err(protocol(format!(
                "frame of {body_len} bytes (limit {max_body})"
            )));
        }
        let rest = body_len
            .checked_sub(5 + MAC_LEN)
            .and_then(|r| r.checked_sub(json_len))
            .ok_or_else(|| {
                protocol(format!(
                    "a frame of {body_len} bytes cannot hold its header and MAC"
                ))
            })?;
        // What follows the head MAC: nothing, or a tail and its MAC.
        let tail_len = match rest {
            0 => 0,
            n if n > MAC_LEN => n - MAC_LEN,
            n => return Err(protocol(format!("{n} bytes after the head MAC"))),
        };
        let mut json = vec![0u8; json_len];
        r.read_exact(&mut json).await.map_err(closed)?;
        let first = self.mac.seq == 0;
        let mac = self.mac.start(fixed[4], &json, tail_len);
        // `blake3::Hash` compares in constant time.
        if read_mac(r).await? != mac.finalize() {
            let frame = kind_name(fixed[4]).to_string();
            return Err(if first {
                TransferError::Unauthenticated { frame }
            } else {
                TransferError::Mac { frame }
            }
            .into());
        }
        let kind =
            Kind::from_u8(fixed[4]).ok_or_else(|| protocol(format!("frame kind {}", fixed[4])))?;
        Ok(FrameHead {
            kind,
            json,
            tail_len,
            mac,
            seen: 0,
        })
    }

    /// Read and authenticate one frame of at most `max_body` bytes.
    pub async fn read_frame<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        max_body: usize,
    ) -> Result<Frame, RuntimeError> {
        let head = self.read_head(r, max_body).await?;
        head.read_rest(r).await
    }
}

/// Decode's first move on a connection: a challenge with a fresh nonce. Returns the MAC state
/// of both directions, bound to that nonce.
pub async fn write_challenge<W: AsyncWrite + Unpin>(
    w: &mut W,
    key: &TransferKey,
) -> std::io::Result<(FrameWriter, FrameReader)> {
    let nonce = fresh_nonce();
    let mut tx = FrameWriter {
        mac: MacStream::new(key, Direction::ToPrefill),
    };
    let challenge = Challenge {
        version: PROTOCOL_VERSION,
        nonce,
    };
    tx.write_frame(w, Kind::Challenge, &challenge, &[]).await?;
    tx.mac.bind_decode(&nonce);
    let mut rx = FrameReader {
        mac: MacStream::new(key, Direction::ToDecode),
    };
    rx.mac.bind_decode(&nonce);
    Ok((tx, rx))
}

/// Decode: read the `Hello` that must follow the challenge, authenticated against it; both
/// directions are then bound to prefill's nonce too.
pub async fn read_hello<R: AsyncRead + Unpin>(
    r: &mut R,
    tx: &mut FrameWriter,
    rx: &mut FrameReader,
    max_body: usize,
) -> Result<Hello, RuntimeError> {
    let hello = match rx.read_frame(r, max_body).await? {
        Frame::Hello(h) => *h,
        f => return Err(protocol(format!("expected hello, got {}", f.kind()))),
    };
    tx.mac.bind_prefill(&hello.nonce);
    rx.mac.bind_prefill(&hello.nonce);
    Ok(hello)
}

/// Prefill: read decode's challenge (refused unless it is under this cluster's key), then
/// send `hello`, bound to it and to a fresh nonce of ours (set in `hello.nonce`). Returns the
/// MAC state of both directions for the rest of the connection.
pub async fn write_hello<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
    r: &mut R,
    w: &mut W,
    key: &TransferKey,
    hello: &mut Hello,
    max_body: usize,
) -> Result<(FrameWriter, FrameReader), RuntimeError> {
    let mut rx = FrameReader {
        mac: MacStream::new(key, Direction::ToPrefill),
    };
    let challenge = match rx.read_frame(r, max_body).await? {
        Frame::Challenge(c) => c,
        f => return Err(protocol(format!("expected a challenge, got {}", f.kind()))),
    };
    if challenge.version != PROTOCOL_VERSION {
        return Err(protocol(format!(
            "decode speaks protocol version {} (this node speaks {PROTOCOL_VERSION})",
            challenge.version
        )));
    }
    rx.mac.bind_decode(&challenge.nonce);
    let mut tx = FrameWriter {
        mac: MacStream::new(key, Direction::ToDecode),
    };
    tx.mac.bind_decode(&challenge.nonce);
    hello.nonce = fresh_nonce();
    tx.write_frame(w, Kind::Hello, hello, &[])
        .await
        .map_err(closed)?;
    tx.mac.bind_prefill(&hello.nonce);
    rx.mac.bind_prefill(&hello.nonce);
    Ok((tx, rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_hello() -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            nonce: [0; NONCE_LEN],
            request: 7,
            tenant: "t".into(),
            model: "m".into(),
            prompt: vec![1, 2, 3],
            token_count: 3,
            page_count: 1,
            page_size: 16,
            layers: 1,
            kv_dim: 2,
            dtype: DTYPE.into(),
            params: SamplingParams::default(),
            cached_tokens: 0,
        }
    }

    /// One connection's MAC state after the handshake: decode's (writer, reader), then
    /// prefill's, and the Hello decode read.
    async fn connect(
        decode_key: &TransferKey,
        prefill_key: &TransferKey,
    ) -> Result<
        (
            (FrameWriter, FrameReader),
            (FrameWriter, FrameReader),
            Hello,
        ),
        RuntimeError,
    > {
        let (mut d, p) = tokio::io::duplex(1 << 16);
        let (mut pr, mut pw) = tokio::io::split(p);
        let decode = async {
            let (mut tx, mut rx) = write_challenge(&mut d, decode_key).await.map_err(closed)?;
            let hello = read_hello(&mut d, &mut tx, &mut rx, 1 << 20).await?;
            Ok::<_, RuntimeError>((tx, rx, hello))
        };
        let prefill = async move {
            let mut hello = sample_hello();
            let r = write_hello(&mut pr, &mut pw, prefill_key, &mut hello, 1 << 20).await;
            // Let decode's read end rather than wait for a Hello that never comes: the
            // stream closes only once both of its halves are gone.
            drop((pr, pw));
            r
        };
        let (d, p) = tokio::join!(decode, prefill);
        let (p, (dtx, drx, hello)) = (p?, d?);
        Ok(((dtx, drx), p, hello))
    }

    fn pages_header() -> PagesHeader {
        PagesHeader {
            tenant: "t".into(),
            request: 7,
            pages: vec![PageHeader {
                index: 0,
                tokens: 2,
            }],
        }
    }

    fn err_reason(e: RuntimeError) -> &'static str {
        match e {
            RuntimeError::Transfer(t) => t.reason(),
            other => panic!("not a transfer error: {other}"),
        }
    }

    #[tokio::test]
    async fn frames_round_trip_authenticated_and_truncation_is_peer_closed() {
        let key = TransferKey::generate();
        let ((mut dtx, mut drx), (mut ptx, mut prx), hello) = connect(&key, &key).await.unwrap();
        assert_eq!(hello.tenant, "t");
        assert_ne!(hello.nonce, [0; NONCE_LEN], "prefill's nonce is fresh");
        let mut buf = Vec::new();
        ptx.write_frame(&mut buf, Kind::Pages, &pages_header(), b"abcd")
            .await
            .unwrap();
        ptx.write_empty(&mut buf, Kind::Ack).await.unwrap();
        let err = drx
            .clone()
            .read_frame(&mut &buf[..buf.len() / 2], 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(err_reason(err), "peer_closed");
        let mut r = &buf[..];
        match drx.read_frame(&mut r, 1 << 20).await.unwrap() {
            Frame::Pages(h, tail) => {
                assert_eq!(h, pages_header());
                assert_eq!(&tail[..], b"abcd");
            }
            f => panic!("got {f:?}"),
        }
        assert!(matches!(
            drx.read_frame(&mut r, 1 << 20).await.unwrap(),
            Frame::Ack
        ));
        // The other way too.
        let mut back = Vec::new();
        dtx.write_empty(&mut back, Kind::Accept).await.unwrap();
        assert!(matches!(
            prx.read_frame(&mut &back[..], 1 << 20).await.unwrap(),
            Frame::Accept
        ));
    }

    #[tokio::test]
    async fn every_changed_byte_of_a_frame_is_refused() {
        let key = TransferKey::generate();
        let ((_, drx), (mut ptx, _), _) = connect(&key, &key).await.unwrap();
        let mut buf = Vec::new();
        ptx.write_frame(&mut buf, Kind::Pages, &pages_header(), b"abcdefgh")
            .await
            .unwrap();
        assert!(drx.clone().read_frame(&mut &buf[..], 1 << 20).await.is_ok());
        for i in 0..buf.len() {
            let mut bad = buf.clone();
            bad[i] ^= 0x01;
            let err = drx
                .clone()
                .read_frame(&mut &bad[..], 1 << 20)
                .await
                .expect_err("a changed byte must be refused");
            // Length fields may make the frame malformed or short; every other byte is the MAC's.
            if i >= 9 {
                assert_eq!(err_reason(err), "mac", "byte {i}");
            }
        }
    }

    #[tokio::test]
    async fn reordered_foreign_and_reflected_frames_are_refused() {
        let key = TransferKey::generate();
        let ((mut dtx, mut drx), (mut ptx, _), _) = connect(&key, &key).await.unwrap();
        let (mut first, mut second) = (Vec::new(), Vec::new());
        ptx.write_frame(&mut first, Kind::Pages, &pages_header(), b"1111")
            .await
            .unwrap();
        ptx.write_frame(&mut second, Kind::Pages, &pages_header(), b"2222")
            .await
            .unwrap();
        // The second batch where the first belongs.
        let err = drx
            .clone()
            .read_frame(&mut &second[..], 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(err_reason(err), "mac");
        // The same frame, at the same place, of another connection (other nonces).
        let ((_, mut other_rx), _, _) = connect(&key, &key).await.unwrap();
        let err = other_rx
            .read_frame(&mut &first[..], 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(err_reason(err), "mac");
        // Decode's own frame sent back to it.
        let mut own = Vec::new();
        dtx.write_empty(&mut own, Kind::Accept).await.unwrap();
        let err = drx.read_frame(&mut &own[..], 1 << 20).await.unwrap_err();
        assert_eq!(err_reason(err), "mac");
    }

    #[tokio::test]
    async fn a_peer_without_the_key_is_refused_both_ways() {
        let (ours, theirs) = (TransferKey::generate(), TransferKey::generate());
        // Prefill refuses a decode node that does not hold the key, before sending a Hello.
        let Err(err) = connect(&theirs, &ours).await else {
            panic!("a decode node without the key was not refused")
        };
        assert_eq!(err_reason(err), "unauthenticated");
        // Decode refuses a Hello under another key, whatever it claims.
        let (mut d, mut p) = tokio::io::duplex(1 << 16);
        let (mut tx, mut rx) = write_challenge(&mut d, &ours).await.unwrap();
        let mut challenge = FrameReader {
            mac: MacStream::new(&theirs, Direction::ToPrefill),
        };
        // Its challenge is readable by anyone, but only under our key authentic.
        assert!(challenge.read_head(&mut p, 1 << 20).await.is_err());
        let mut forger = FrameWriter {
            mac: MacStream::new(&theirs, Direction::ToDecode),
        };
        forger
            .write_frame(&mut p, Kind::Hello, &sample_hello(), &[])
            .await
            .unwrap();
        let err = read_hello(&mut d, &mut tx, &mut rx, 1 << 20)
            .await
            .unwrap_err();
        assert_eq!(err_reason(err), "unauthenticated");
    }

    #[tokio::test]
    async fn oversized_frames_are_protocol_errors() {
        let key = TransferKey::generate();
        let ((_, mut drx), (mut ptx, _), _) = connect(&key, &key).await.unwrap();
        let mut buf = Vec::new();
        ptx.write_frame(&mut buf, Kind::Pages, &serde_json::json!({}), &[0u8; 64])
            .await
            .unwrap();
        let err = drx.read_frame(&mut &buf[..], 16).await.unwrap_err();
        assert!(matches!(
            err,
            RuntimeError::Transfer(TransferError::Protocol(_))
        ));
    }
}
