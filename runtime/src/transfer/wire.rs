//! The KV transfer wire format: length-prefixed frames over one TCP connection per request.
//!
//! A frame is `[u32 body length][u8 kind][u32 header length][JSON header][binary tail]`, all
//! integers little-endian. Control frames carry only the JSON header; `Pages` carries the page
//! data of a batch as its tail and `Commit` the last position's logits. JSON keeps the control
//! messages readable in a capture; the bulk bytes are never encoded.
//!
//! Prefill sends `Hello`, waits for `Accept` or `Reject`, sends `Pages`* then `Commit`, and
//! waits for `Ack` or `Nack`. After `Ack` the decode node sends `Event`s until the generation
//! ends; either side closing the connection ends the request.

use bytes::{BufMut, Bytes};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::engine::{FinishReason, GenEvent, Usage};
use crate::error::{RuntimeError, TransferError};
use crate::sampling::SamplingParams;

/// Bumped on any incompatible change; a decode node refuses other versions.
pub const PROTOCOL_VERSION: u32 = 1;

/// Element type of the K/V on the wire: f32, little-endian (the pool's own layout).
pub const DTYPE: &str = "f32le";

/// The checksum of a page's (or the logits') bytes: xxh3-64, the same hash `KvPool`'s
/// `export_page` and `import_page` compute while they copy a page.
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// [`checksum`] computed piece by piece (`update`, then `digest`): the same value.
pub type Checksum = xxhash_rust::xxh3::Xxh3;

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
            _ => return None,
        })
    }
}

/// The handshake: who the request is, what its prompt is, and what will be sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
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
}

/// One page of a batch; its bytes follow in the frame's tail, in header order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageHeader {
    /// Position of the page in the sequence's block table.
    pub index: u32,
    /// Tokens of KV in the page (a full page except possibly the last).
    pub tokens: u32,
    pub checksum: u64,
}

/// A batch of pages, with the owner the sender's pool tagged them with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagesHeader {
    pub tenant: String,
    pub request: u64,
    pub pages: Vec<PageHeader>,
}

/// The totals the receiver checks everything against; the logits are the tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Commit {
    pub token_count: usize,
    pub page_count: usize,
    /// Page bytes sent in all batches.
    pub bytes: u64,
    pub logits_checksum: u64,
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

fn protocol(msg: impl Into<String>) -> RuntimeError {
    TransferError::Protocol(msg.into()).into()
}

/// Write one frame: a JSON header and an optional binary tail.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: Kind,
    header: &impl Serialize,
    tail: &[u8],
) -> std::io::Result<()> {
    write_head(w, kind, header, tail.len()).await?;
    if !tail.is_empty() {
        w.write_all(tail).await?;
    }
    Ok(())
}

/// Write a frame's length, kind and JSON header; the caller writes exactly `tail_len` bytes
/// of tail after it (the sender writes pages straight from its pool this way).
pub async fn write_head<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: Kind,
    header: &impl Serialize,
    tail_len: usize,
) -> std::io::Result<()> {
    let json = serde_json::to_vec(header).map_err(std::io::Error::other)?;
    let body_len = 1 + 4 + json.len() + tail_len;
    let body_len = u32::try_from(body_len)
        .map_err(|_| std::io::Error::other(format!("frame of {body_len} bytes is too large")))?;
    let mut head = Vec::with_capacity(9 + json.len());
    head.extend_from_slice(&body_len.to_le_bytes());
    head.push(kind as u8);
    head.extend_from_slice(&(json.len() as u32).to_le_bytes());
    head.extend_from_slice(&json);
    w.write_all(&head).await
}

/// Write a frame with no header fields.
pub async fn write_empty<W: AsyncWrite + Unpin>(w: &mut W, kind: Kind) -> std::io::Result<()> {
    write_frame(w, kind, &serde_json::json!({}), &[]).await
}

/// A frame's kind and JSON header, read; its tail (`tail_len` bytes) is still on the wire.
#[derive(Debug)]
pub struct FrameHead {
    pub kind: Kind,
    json: Vec<u8>,
    pub tail_len: usize,
}

impl FrameHead {
    /// The JSON header as `T`, or a protocol error.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, RuntimeError> {
        serde_json::from_slice(&self.json).map_err(|e| protocol(format!("bad header: {e}")))
    }
}

fn closed(e: std::io::Error) -> RuntimeError {
    TransferError::PeerClosed(e.to_string()).into()
}

/// Read a frame's length, kind and JSON header, for a body of at most `max_body` bytes.
pub async fn read_head<R: AsyncRead + Unpin>(
    r: &mut R,
    max_body: usize,
) -> Result<FrameHead, RuntimeError> {
    let mut fixed = [0u8; 9];
    r.read_exact(&mut fixed).await.map_err(closed)?;
    let body_len = u32::from_le_bytes(fixed[0..4].try_into().expect("4 bytes")) as usize;
    if body_len < 5 || body_len > max_body {
        return Err(protocol(format!(
            "frame of {body_len} bytes (limit {max_body})"
        )));
    }
    let kind =
        Kind::from_u8(fixed[4]).ok_or_else(|| protocol(format!("frame kind {}", fixed[4])))?;
    let json_len = u32::from_le_bytes(fixed[5..9].try_into().expect("4 bytes")) as usize;
    if 5 + json_len > body_len {
        return Err(protocol("header longer than its frame"));
    }
    let mut json = vec![0u8; json_len];
    r.read_exact(&mut json).await.map_err(closed)?;
    Ok(FrameHead {
        kind,
        json,
        tail_len: body_len - 5 - json_len,
    })
}

/// Read the tail of a frame whose head was read, and decode the whole frame.
pub async fn read_rest<R: AsyncRead + Unpin>(
    r: &mut R,
    head: FrameHead,
) -> Result<Frame, RuntimeError> {
    // Read into uninitialised capacity: zeroing megabytes per batch costs a pass over them.
    let mut tail = bytes::BytesMut::with_capacity(head.tail_len);
    while tail.len() < head.tail_len {
        let left = head.tail_len - tail.len();
        let mut limited = (&mut tail).limit(left);
        match r.read_buf(&mut limited).await {
            Ok(0) => return Err(TransferError::PeerClosed("connection closed".into()).into()),
            Ok(_) => {}
            Err(e) => return Err(closed(e)),
        }
    }
    let tail = tail.freeze();
    let no_tail = |f: Frame| {
        if tail.is_empty() {
            Ok(f)
        } else {
            Err(protocol(format!("{} frame with a tail", f.kind())))
        }
    };
    match head.kind {
        Kind::Hello => no_tail(Frame::Hello(Box::new(head.parse()?))),
        Kind::Accept => no_tail(Frame::Accept),
        Kind::Reject => no_tail(Frame::Reject(head.parse::<ErrorFrame>()?.error)),
        Kind::Pages => Ok(Frame::Pages(head.parse()?, tail)),
        Kind::Commit => Ok(Frame::Commit(head.parse()?, tail)),
        Kind::Ack => no_tail(Frame::Ack),
        Kind::Nack => no_tail(Frame::Nack(head.parse::<ErrorFrame>()?.error)),
        Kind::Event => no_tail(Frame::Event(head.parse()?)),
    }
}

/// Read one frame of at most `max_body` bytes. A closed connection is `PeerClosed`; anything
/// malformed is a protocol error.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_body: usize,
) -> Result<Frame, RuntimeError> {
    let head = read_head(r, max_body).await?;
    read_rest(r, head).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_and_truncation_is_peer_closed() {
        let mut buf = Vec::new();
        let hdr = PagesHeader {
            tenant: "t".into(),
            request: 7,
            pages: vec![PageHeader {
                index: 0,
                tokens: 2,
                checksum: checksum(b"abcd"),
            }],
        };
        write_frame(&mut buf, Kind::Pages, &hdr, b"abcd")
            .await
            .unwrap();
        write_empty(&mut buf, Kind::Ack).await.unwrap();
        let mut r = &buf[..];
        match read_frame(&mut r, 1 << 20).await.unwrap() {
            Frame::Pages(h, tail) => {
                assert_eq!(h, hdr);
                assert_eq!(&tail[..], b"abcd");
            }
            f => panic!("got {f:?}"),
        }
        assert!(matches!(
            read_frame(&mut r, 1 << 20).await.unwrap(),
            Frame::Ack
        ));
        let mut cut = &buf[..buf.len() / 2];
        let _ = read_frame(&mut cut, 1 << 20).await;
        let err = read_frame(&mut cut, 1 << 20).await.unwrap_err();
        assert_eq!(err.code(), "kv_transfer_failed");
    }

    #[tokio::test]
    async fn oversized_and_unknown_frames_are_protocol_errors() {
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Pages, &serde_json::json!({}), &[0u8; 64])
            .await
            .unwrap();
        let err = read_frame(&mut &buf[..], 16).await.unwrap_err();
        assert!(matches!(
            err,
            RuntimeError::Transfer(TransferError::Protocol(_))
        ));
        let mut bad = buf.clone();
        bad[4] = 99;
        let err = read_frame(&mut &bad[..], 1 << 20).await.unwrap_err();
        assert!(matches!(
            err,
            RuntimeError::Transfer(TransferError::Protocol(_))
        ));
    }
}
