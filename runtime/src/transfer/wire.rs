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

use crate::engine::{FinishReason, Usage};
use crate::error::{RuntimeError, TransferError};
use crate::sampling::SamplingParams;

/// Bumped on any incompatible change; a decode node refuses other versions.
pub const PROTOCOL_VERSION: u32 = 1;

/// Element type of the K/V on the wire: f32, little-endian (the pool's own layout).
pub const DTYPE: &str = "f32le";

/// The checksum of a page's (or the logits') bytes.
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
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
    let json = serde_json::to_vec(header).map_err(std::io::Error::other)?;
    let body_len = 1 + 4 + json.len() + tail.len();
    let body_len = u32::try_from(body_len)
        .map_err(|_| std::io::Error::other(format!("frame of {body_len} bytes is too large")))?;
    let mut head = Vec::with_capacity(9 + json.len());
    head.extend_from_slice(&body_len.to_le_bytes());
    head.push(kind as u8);
    head.extend_from_slice(&(json.len() as u32).to_le_bytes());
    head.extend_from_slice(&json);
    w.write_all(&head).await?;
    if !tail.is_empty() {
        w.write_all(tail).await?;
    }
    Ok(())
}

/// Write a frame with no header fields.
pub async fn write_empty<W: AsyncWrite + Unpin>(w: &mut W, kind: Kind) -> std::io::Result<()> {
    write_frame(w, kind, &serde_json::json!({}), &[]).await
}

/// Read one frame of at most `max_body` bytes. A closed connection is `PeerClosed`; anything
/// malformed is a protocol error.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_body: usize,
) -> Result<Frame, RuntimeError> {
    let mut len = [0u8; 4];
    if let Err(e) = r.read_exact(&mut len).await {
        return Err(TransferError::PeerClosed(e.to_string()).into());
    }
    let body_len = u32::from_le_bytes(len) as usize;
    if body_len < 5 || body_len > max_body {
        return Err(protocol(format!(
            "frame of {body_len} bytes (limit {max_body})"
        )));
    }
    // Read into uninitialised capacity: zeroing megabytes per batch costs a pass over them.
    let mut body = bytes::BytesMut::with_capacity(body_len);
    while body.len() < body_len {
        let left = body_len - body.len();
        let mut limited = (&mut body).limit(left);
        match r.read_buf(&mut limited).await {
            Ok(0) => return Err(TransferError::PeerClosed("connection closed".into()).into()),
            Ok(_) => {}
            Err(e) => return Err(TransferError::PeerClosed(e.to_string()).into()),
        }
    }
    let kind = Kind::from_u8(body[0]).ok_or_else(|| protocol(format!("frame kind {}", body[0])))?;
    let json_len = u32::from_le_bytes(body[1..5].try_into().expect("4 bytes")) as usize;
    if 5 + json_len > body_len {
        return Err(protocol("header longer than its frame"));
    }
    let body = body.freeze();
    let json = body.slice(5..5 + json_len);
    let tail = body.slice(5 + json_len..);
    fn parse<T: serde::de::DeserializeOwned>(json: &[u8]) -> Result<T, RuntimeError> {
        serde_json::from_slice(json).map_err(|e| protocol(format!("bad header: {e}")))
    }
    let no_tail = |f: Frame| {
        if tail.is_empty() {
            Ok(f)
        } else {
            Err(protocol(format!("{} frame with a tail", f.kind())))
        }
    };
    match kind {
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
