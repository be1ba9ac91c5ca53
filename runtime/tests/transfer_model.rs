//! Exhaustive model of admission, the KV pool, the disaggregated prefill -> decode KV transfer
//! and release (issue 4, "Formal model"), checked with stateright's BFS checker.
//!
//! The model does not use the runtime's types: it mirrors their names and rules at a small
//! scale (pages of one token, a handful of pages, two or three requests from two tenants) so
//! that every interleaving of engine steps, protocol messages, client disconnects, lease
//! expiries, lost messages, broken connections and decode restarts is explored. See
//! `docs/transfer-model.md` for what is abstracted and how each property maps to the code.
//!
//! A configuration with the 2026 bug put back (a placeholder admitted for a rejected prompt
//! and forwarded with the original length; decode trusting the declared length) must produce
//! a counterexample: that proves the model can fail.

use std::collections::{BTreeSet, VecDeque};
use std::time::Instant;

use stateright::{Checker, HasDiscoveries, Model, Path, Property};

// ---------------------------------------------------------------------------------------------
// Names shared with runtime/src/kv/pool.rs
// ---------------------------------------------------------------------------------------------

/// Index of a request in the configuration (the node-unique request number).
type Req = usize;

/// Who a sequence is: the tenant and the request number (`kv::Owner`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Owner {
    tenant: u8,
    request: u8,
}

/// A block-table entry: which page, and which allocation of it (`kv::PageRef`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PageRef {
    page: u8,
    epoch: u8,
}

/// What physically lies in a page: poison, or K/V computed for some owner. This is ghost state
/// (the real pool holds floats); it is what "reading another request's data" means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Content {
    Poison,
    Kv(Owner),
}

/// One page's bookkeeping (`PageState` + `PageData::tag` + the data).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Page {
    epoch: u8,
    allocated: bool,
    /// The owner's own hold plus any extra holders (transfers).
    holders: u8,
    tag: Option<(Owner, u8)>,
    content: Content,
}

/// A fixed pool of pages with a FIFO free list and up-front reservations (`kv::KvPool`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct KvPool {
    pages: Vec<Page>,
    free: VecDeque<u8>,
    reserved: u8,
}

/// One sequence's view of the pool (`kv::SeqKv`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SeqKv {
    owner: Owner,
    table: Vec<PageRef>,
    len: u8,
    reservation: u8,
}

/// An earlier request of tenant 0 that ran on decode before the modelled ones.
const EARLIER: Owner = Owner {
    tenant: 0,
    request: 9,
};

/// Why a pool operation failed. A tag mismatch is an isolation alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Isolation;

impl KvPool {
    fn new(pages: u8, content: Content) -> Self {
        KvPool {
            pages: (0..pages)
                .map(|_| Page {
                    epoch: 0,
                    allocated: false,
                    holders: 0,
                    tag: None,
                    content,
                })
                .collect(),
            free: (0..pages).collect(),
            reserved: 0,
        }
    }

    fn capacity_tokens(&self) -> usize {
        self.pages.len()
    }

    /// All or nothing; fails when the free pages not promised to others are too few.
    fn try_reserve(&mut self, pages: u8) -> Option<u8> {
        let available = (self.free.len() as u8).saturating_sub(self.reserved);
        if pages > available {
            return None;
        }
        self.reserved += pages;
        Some(pages)
    }

    fn open(owner: Owner, reservation: u8) -> SeqKv {
        SeqKv {
            owner,
            table: Vec::new(),
            len: 0,
            reservation,
        }
    }

    /// Make room for `n` more tokens, allocating pages from the reservation (front of the free
    /// list). Panics on a reservation overrun: the model must never do that.
    fn grow(&mut self, seq: &mut SeqKv, n: u8) {
        let need = seq.len + n;
        while (seq.table.len() as u8) < need {
            assert!(seq.reservation > 0, "sequence outgrew its reservation");
            let page = self
                .free
                .pop_front()
                .expect("a reservation guarantees a free page");
            self.reserved -= 1;
            seq.reservation -= 1;
            let st = &mut self.pages[page as usize];
            st.epoch += 1;
            st.allocated = true;
            st.holders = 1;
            st.tag = Some((seq.owner, st.epoch));
            seq.table.push(PageRef {
                page,
                epoch: st.epoch,
            });
        }
    }

    fn tag_ok(&self, owner: Owner, r: PageRef) -> bool {
        self.pages[r.page as usize].tag == Some((owner, r.epoch))
    }

    /// Write K/V of position `pos` (one token = one page). Checks the tag first.
    fn write(&mut self, seq: &SeqKv, pos: u8, content: Content) -> Result<(), Isolation> {
        let r = seq.table[pos as usize];
        if !self.tag_ok(seq.owner, r) {
            return Err(Isolation);
        }
        self.pages[r.page as usize].content = content;
        Ok(())
    }

    /// Read one page on behalf of `owner`: a tag mismatch is an isolation error and nothing is
    /// read.
    fn read(&self, owner: Owner, r: PageRef) -> Result<Content, Isolation> {
        if !self.tag_ok(owner, r) {
            return Err(Isolation);
        }
        Ok(self.pages[r.page as usize].content)
    }

    /// Extra hold on every page of `seq`, checked against the owner.
    fn hold(&mut self, seq: &SeqKv) -> Result<Vec<PageRef>, Isolation> {
        if !seq.table.iter().all(|&r| self.tag_ok(seq.owner, r)) {
            return Err(Isolation);
        }
        for r in &seq.table {
            self.pages[r.page as usize].holders += 1;
        }
        Ok(seq.table.clone())
    }

    /// Drop a hold taken with `hold` (stale epochs and zero counts are ignored, as in pool.rs).
    fn unhold(&mut self, refs: &[PageRef], poison: bool) {
        let mut to_free = Vec::new();
        for r in refs {
            let st = &mut self.pages[r.page as usize];
            if st.epoch == r.epoch && st.holders > 0 {
                st.holders -= 1;
                if st.holders == 0 {
                    to_free.push(r.page);
                }
            }
        }
        self.free_pages(&to_free, poison);
    }

    /// End a sequence: drop the owner's hold on each page, return the unused reservation.
    fn release(&mut self, seq: SeqKv, poison: bool) {
        self.reserved -= seq.reservation;
        let mut to_free = Vec::new();
        for r in &seq.table {
            let st = &mut self.pages[r.page as usize];
            if !st.allocated || st.epoch != r.epoch || st.holders == 0 {
                continue; // pool.rs refuses and raises the alarm; the model never gets here
            }
            st.holders -= 1;
            if st.holders == 0 {
                to_free.push(r.page);
            }
        }
        self.free_pages(&to_free, poison);
    }

    /// Untag (and poison, unless the 2026 engine is modelled) and append to the free list.
    fn free_pages(&mut self, pages: &[u8], poison: bool) {
        for &page in pages {
            let st = &mut self.pages[page as usize];
            st.tag = None;
            st.allocated = false;
            if poison {
                st.content = Content::Poison;
            }
            self.free.push_back(page);
        }
    }

    fn is_full_again(&self) -> bool {
        self.free.len() == self.pages.len()
            && self.reserved == 0
            && self.pages.iter().all(|p| !p.allocated && p.holders == 0)
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Spec {
    tenant: u8,
    prompt: u8,
    max_tokens: u8,
}

/// Switches that put back known bugs (all false = Bulkhead as designed).
#[derive(Clone, Debug, Default)]
struct Bugs {
    /// 2026: a prompt the prefill pool cannot hold is replaced by a one-token placeholder that
    /// is admitted and forwarded with the ORIGINAL declared length.
    placeholder: bool,
    /// 2026: decode does not compare received tokens with the declared count; it takes the
    /// declared length and attends over positions whose pages it never received.
    trust_declared_length: bool,
    /// 2026 engine: freed pages are not poisoned (stale K/V stays in them).
    no_poison: bool,
    /// Pre-2026: a client disconnect drops the transfer's hold at once, mid-transfer.
    unhold_on_disconnect: bool,
    /// Decode has no idle timeout on a transfer connection (waits for P forever).
    no_decode_timeout: bool,
    /// Protocol v1: decode does not verify a MAC on the frames it receives (xxh3 checksums,
    /// which anyone can recompute, are all it checks).
    no_mac: bool,
    /// Frames are MAC'd, but the MAC does not cover decode's challenge nonce: it is not bound
    /// to one connection.
    no_nonce: bool,
}

#[derive(Clone, Debug)]
struct TransferModel {
    requests: Vec<Spec>,
    context_window: u8,
    prefill_pages: u8,
    decode_pages: u8,
    /// Message losses, broken connections and decode restarts, all together.
    faults: u8,
    /// Frames a network attacker may inject, modify, replay or reorder on P -> D.
    attacks: u8,
    bugs: Bugs,
}

// ---------------------------------------------------------------------------------------------
// Protocol and per-node state
// ---------------------------------------------------------------------------------------------

/// Error codes a client can see (all non-2xx).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Code {
    /// 413 `exceeds_kv_pool` / `context_window_exceeded` / 400 `empty_prompt`
    Admission,
    /// 503 momentarily full (retryable)
    Overloaded,
    /// 502 transfer failed: Nack, broken connection, decode restart
    TransferFailed,
    /// 504 lease expired / no answer from decode
    Timeout,
    /// 500 isolation alarm (owner tag mismatch)
    Isolation,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Outcome {
    /// HTTP 200 with the generated tokens.
    Success,
    /// Non-2xx with an error envelope.
    Error(Code),
    /// The client went away; no response is delivered.
    Cancelled,
}

/// Frames P -> D on the transfer connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum ToDecode {
    Hello {
        owner: Owner,
        /// `prompt_tokens.len()`
        prompt_len: u8,
        token_count: u8,
        page_count: u8,
        max_tokens: u8,
    },
    /// One page per batch: index, the owner tag it carries, its contents.
    Pages {
        index: u8,
        owner: Owner,
        content: Content,
    },
    Commit {
        token_count: u8,
        page_count: u8,
    },
    /// FIN / RST: the connection is closed.
    Close,
}

/// The MAC a frame carries (`wire::FrameHead`): keyed BLAKE3 over decode's challenge nonce,
/// the frame's sequence number on its connection and the whole frame. Only a holder of the
/// cluster's transfer key (P, D) can make one; modelled as the exact inputs it covers, so
/// "the MAC verifies" means "a key holder signed exactly this frame, at this position, on this
/// connection".
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Mac {
    nonce: u8,
    seq: u8,
    over: ToDecode,
}

/// A frame on the wire: its contents and the MAC it carries (none for a forgery from
/// scratch; `Close` is the TCP FIN/RST and carries none).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Frame {
    body: ToDecode,
    mac: Option<Mac>,
}

impl Frame {
    fn close() -> Self {
        Frame {
            body: ToDecode::Close,
            mac: None,
        }
    }
}

/// Whose K/V an attacker injects: an owner that is none of the modelled requests.
const MALLORY: Owner = Owner {
    tenant: 2,
    request: 7,
};

/// Frames D -> P: handshake answers, then decode events.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum ToPrefill {
    Accept,
    Reject(Code),
    Ack,
    Nack,
    /// Decode finished (the token events before it are not modelled one by one).
    Done,
    /// Decode failed (isolation alarm).
    Failed(Code),
    Close,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Conn {
    Unused,
    Open,
    Closed,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum TStep {
    AwaitAccept,
    /// Sending page `n` next.
    Sending(u8),
    AwaitAck,
}

/// The request as prefill node P (and the client behind it) sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum PPhase {
    /// `/v1/generate` arrived, admission not yet run.
    Arrived,
    /// Admitted; waiting for the pool to have room for the prompt.
    Waiting,
    /// The engine computes the prompt's K/V, one page per step.
    Prefill(SeqKv),
    /// The transfer task holds the pages.
    Transfer {
        held: Vec<PageRef>,
        step: TStep,
    },
    /// After Ack: relaying decode's events to the client.
    Relay,
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PReq {
    phase: PPhase,
    /// The client's connection is still open.
    client: bool,
    outcome: Option<Outcome>,
    /// Tokens actually computed at P (1 for the 2026 placeholder).
    prompt: u8,
}

/// The request as decode node D sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum DPhase {
    Idle,
    Receiving {
        seq: SeqKv,
        token_count: u8,
        prompt_len: u8,
        page_count: u8,
        max_tokens: u8,
        received: u8,
    },
    Decoding {
        seq: SeqKv,
        max_tokens: u8,
    },
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    p: Vec<PReq>,
    d: Vec<DPhase>,
    conn: Vec<Conn>,
    to_d: Vec<VecDeque<Frame>>,
    /// Frames P has sent on each connection (the next MAC's sequence number) and frames D
    /// has accepted on it (the sequence number D expects next).
    tx_seq: Vec<u8>,
    rx_seq: Vec<u8>,
    attacks_left: u8,
    /// Every signed frame the attacker has seen on the wire (empty unless attacks > 0).
    seen: Vec<Frame>,
    to_p: Vec<VecDeque<ToPrefill>>,
    prefill_pool: KvPool,
    decode_pool: KvPool,
    faults_left: u8,
    // ---- ghost state, only read by the properties ----
    /// Admission (at P, or at D) rejected the request.
    rejected: Vec<bool>,
    /// First read of data that belongs to another owner: (node, reader, page).
    foreign_read: Option<(char, Owner, u8)>,
    /// First request for which D accepted something its P did not send: a Hello for another
    /// owner, or a page with contents P did not compute for it.
    forged_import: Option<Req>,
    /// D refused a frame whose MAC did not verify.
    forgery_refused: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    Admit(Req),
    Reserve(Req),
    PrefillStep(Req),
    Handoff(Req),
    SendPage(Req),
    SendCommit(Req),
    DeliverToDecode(Req),
    DeliverToPrefill(Req),
    DecodeStep(Req),
    ClientDisconnect(Req),
    LeaseExpiry(Req),
    DecodeTimeout(Req),
    LoseToDecode(Req),
    LoseToPrefill(Req),
    BreakConnection(Req),
    DecodeRestart,
    PrefillRestart,
    /// Put a page frame of the attacker's making (no valid MAC) next on P -> D.
    Inject(Req),
    /// Rewrite the contents of the next page frame on P -> D, keeping its MAC.
    Modify(Req),
    /// Put a frame seen earlier (any connection, with its MAC) next on P -> D.
    Replay(Req, u8),
    /// Swap the next two frames on P -> D.
    Reorder(Req),
}

// ---------------------------------------------------------------------------------------------
// Transitions
// ---------------------------------------------------------------------------------------------

/// `admission::check_generation`, in pages of one token.
fn check_generation(prompt: u8, max_tokens: u8, context: u8, pool: usize) -> bool {
    prompt > 0 && prompt + max_tokens <= context && (prompt + max_tokens) as usize <= pool
}

impl TransferModel {
    fn owner(&self, r: Req) -> Owner {
        Owner {
            tenant: self.requests[r].tenant,
            request: r as u8,
        }
    }

    fn poison(&self) -> bool {
        !self.bugs.no_poison
    }

    /// What decode's free pages hold at the start: the node has served earlier traffic, so an
    /// unpoisoned pool still holds the K/V of an earlier request of tenant 0; a poisoned one
    /// holds NaN there.
    fn history(&self) -> Content {
        if self.poison() {
            Content::Poison
        } else {
            Content::Kv(EARLIER)
        }
    }

    /// The nonce P's MACs on connection `r` cover: decode's challenge for that connection
    /// (each connection gets a fresh one; `r` stands for it).
    fn nonce(&self, r: Req) -> u8 {
        if self.bugs.no_nonce { 0 } else { r as u8 }
    }

    /// P sends a frame, MAC'd under the next sequence number of its connection.
    fn send_to_d(&self, s: &mut State, r: Req, body: ToDecode) {
        if s.conn[r] != Conn::Open {
            return;
        }
        let mac = Mac {
            nonce: self.nonce(r),
            seq: s.tx_seq[r],
            over: body.clone(),
        };
        s.tx_seq[r] += 1;
        let frame = Frame {
            body,
            mac: Some(mac),
        };
        if self.attacks > 0 && !s.seen.contains(&frame) {
            s.seen.push(frame.clone());
        }
        s.to_d[r].push_back(frame);
    }

    fn send_to_p(s: &mut State, r: Req, m: ToPrefill) {
        if s.conn[r] == Conn::Open {
            s.to_p[r].push_back(m);
        }
    }

    /// P ends the request: the client gets `result` unless it left; P closes the connection.
    fn finish(s: &mut State, r: Req, result: Outcome) {
        let pr = &mut s.p[r];
        pr.outcome = Some(if pr.client {
            result
        } else {
            Outcome::Cancelled
        });
        pr.phase = PPhase::Done;
        if s.conn[r] == Conn::Open {
            s.to_d[r].push_back(Frame::close());
            s.conn[r] = Conn::Closed;
        }
    }

    /// P's transfer task gives up: drop the hold, fail the request, close.
    fn abort_transfer(&self, s: &mut State, r: Req, code: Code) {
        if let PPhase::Transfer { held, .. } = &s.p[r].phase {
            let held = held.clone();
            s.prefill_pool.unhold(&held, self.poison());
        }
        Self::finish(s, r, Outcome::Error(code));
    }

    /// D drops whatever it holds for `r`.
    fn decode_release(&self, s: &mut State, r: Req) {
        match std::mem::replace(&mut s.d[r], DPhase::Done) {
            DPhase::Receiving { seq, .. } | DPhase::Decoding { seq, .. } => {
                s.decode_pool.release(seq, self.poison());
            }
            DPhase::Idle | DPhase::Done => {}
        }
    }

    fn note_read(s: &mut State, node: char, reader: Owner, page: u8, c: Content) {
        if let Content::Kv(o) = c
            && o != reader
            && s.foreign_read.is_none()
        {
            s.foreign_read = Some((node, reader, page));
        }
    }

    fn is_clean(&self, s: &State) -> bool {
        s.p.iter()
            .all(|p| p.phase == PPhase::Done && p.outcome.is_some())
            && s.d.iter().all(|d| matches!(d, DPhase::Idle | DPhase::Done))
            && s.to_d.iter().all(VecDeque::is_empty)
            && s.to_p.iter().all(VecDeque::is_empty)
            && s.prefill_pool.is_full_again()
            && s.decode_pool.is_full_again()
    }

    fn deliver_to_decode(&self, s: &mut State, r: Req) {
        let Some(frame) = s.to_d[r].pop_front() else {
            return;
        };
        // Frames after D has finished with the connection are dropped unread (it is closed).
        let reading = matches!(s.d[r], DPhase::Idle | DPhase::Receiving { .. })
            && frame.body != ToDecode::Close;
        if reading && !self.verify(s, r, &frame) {
            // `wire::FrameReader`: a frame whose MAC fails ends the connection before anything
            // in it is used; D rolls back whatever the transfer had imported.
            s.forgery_refused = true;
            if matches!(s.d[r], DPhase::Idle) {
                s.d[r] = DPhase::Done;
            } else {
                self.decode_release(s, r);
            }
            Self::send_to_p(s, r, ToPrefill::Nack);
            return;
        }
        if reading {
            s.rx_seq[r] += 1;
        }
        match frame.body {
            ToDecode::Hello {
                owner: hello_owner,
                prompt_len,
                token_count,
                page_count,
                max_tokens,
            } => {
                if s.d[r] != DPhase::Idle {
                    return;
                }
                let cap = s.decode_pool.capacity_tokens();
                if !check_generation(token_count, max_tokens, self.context_window, cap) {
                    s.rejected[r] = true;
                    s.d[r] = DPhase::Done;
                    Self::send_to_p(s, r, ToPrefill::Reject(Code::Admission));
                    return;
                }
                let Some(reservation) = s.decode_pool.try_reserve(token_count + max_tokens) else {
                    s.rejected[r] = true;
                    s.d[r] = DPhase::Done;
                    Self::send_to_p(s, r, ToPrefill::Reject(Code::Overloaded));
                    return;
                };
                if hello_owner != self.owner(r) && s.forged_import.is_none() {
                    s.forged_import = Some(r);
                }
                s.d[r] = DPhase::Receiving {
                    seq: KvPool::open(hello_owner, reservation),
                    token_count,
                    prompt_len,
                    page_count,
                    max_tokens,
                    received: 0,
                };
                Self::send_to_p(s, r, ToPrefill::Accept);
            }
            ToDecode::Pages {
                index,
                owner: page_owner,
                content,
            } => {
                let DPhase::Receiving {
                    seq,
                    received,
                    token_count,
                    ..
                } = &mut s.d[r]
                else {
                    return;
                };
                // Owner tag and index must match the Hello; a page beyond the declared count
                // is refused too. (Checksums: a corrupted page is indistinguishable from a
                // lost one here and is not modelled separately.)
                if page_owner != seq.owner || index != *received || *received >= *token_count {
                    self.decode_release(s, r);
                    Self::send_to_p(s, r, ToPrefill::Nack);
                    return;
                }
                s.decode_pool.grow(seq, 1);
                let pos = seq.len;
                s.decode_pool
                    .write(seq, pos, content)
                    .expect("a just-grown page is ours");
                seq.len += 1;
                *received += 1;
                if content != Content::Kv(self.owner(r)) && s.forged_import.is_none() {
                    s.forged_import = Some(r);
                }
            }
            ToDecode::Commit {
                token_count: commit_tokens,
                page_count: commit_pages,
            } => {
                let DPhase::Receiving {
                    seq,
                    token_count,
                    prompt_len,
                    page_count,
                    max_tokens,
                    received,
                } = &mut s.d[r]
                else {
                    return;
                };
                let verified = *received == *token_count
                    && *token_count == *prompt_len
                    && commit_tokens == *token_count
                    && *received == *page_count
                    && commit_pages == *page_count;
                if self.bugs.trust_declared_length {
                    // Take the declared length: grow over the positions never received.
                    let missing = commit_tokens.saturating_sub(seq.len);
                    s.decode_pool.grow(seq, missing);
                    seq.len += missing;
                } else if !verified {
                    self.decode_release(s, r);
                    Self::send_to_p(s, r, ToPrefill::Nack);
                    return;
                }
                let seq = seq.clone();
                let max_tokens = *max_tokens;
                s.d[r] = DPhase::Decoding { seq, max_tokens };
                Self::send_to_p(s, r, ToPrefill::Ack);
            }
            ToDecode::Close => {
                // P closed (or the connection broke): roll back or cancel generation.
                if matches!(s.d[r], DPhase::Receiving { .. } | DPhase::Decoding { .. }) {
                    self.decode_release(s, r);
                }
            }
        }
    }

    /// D's check of a frame's MAC: signed by a key holder, over exactly this frame, at the
    /// position D expects next, on this connection.
    fn verify(&self, s: &State, r: Req, frame: &Frame) -> bool {
        if self.bugs.no_mac {
            return true;
        }
        frame.mac.as_ref().is_some_and(|mac| {
            mac.nonce == self.nonce(r) && mac.seq == s.rx_seq[r] && mac.over == frame.body
        })
    }

    fn deliver_to_prefill(&self, s: &mut State, r: Req) {
        let Some(msg) = s.to_p[r].pop_front() else {
            return;
        };
        let poison = self.poison();
        match (&mut s.p[r].phase, msg) {
            (
                PPhase::Transfer {
                    step: step @ TStep::AwaitAccept,
                    ..
                },
                ToPrefill::Accept,
            ) => *step = TStep::Sending(0),
            (PPhase::Transfer { .. }, ToPrefill::Reject(code)) => {
                self.abort_transfer(s, r, code);
            }
            (
                PPhase::Transfer {
                    held,
                    step: TStep::AwaitAck,
                },
                ToPrefill::Ack,
            ) => {
                // Only now are P's pages released.
                let held = held.clone();
                s.prefill_pool.unhold(&held, poison);
                s.p[r].phase = PPhase::Relay;
                if !s.p[r].client {
                    // Client left during the transfer: now that it completed, cancel decode.
                    Self::finish(s, r, Outcome::Cancelled);
                }
            }
            (PPhase::Transfer { .. }, ToPrefill::Nack) => {
                self.abort_transfer(s, r, Code::TransferFailed);
            }
            (PPhase::Transfer { .. }, ToPrefill::Close) => {
                self.abort_transfer(s, r, Code::TransferFailed);
            }
            (PPhase::Relay, ToPrefill::Done) => Self::finish(s, r, Outcome::Success),
            (PPhase::Relay, ToPrefill::Failed(code)) => Self::finish(s, r, Outcome::Error(code)),
            (PPhase::Relay, ToPrefill::Close) => {
                Self::finish(s, r, Outcome::Error(Code::TransferFailed))
            }
            // Anything else is out of protocol order for this phase: P fails the transfer.
            (PPhase::Transfer { .. } | PPhase::Relay, _) => {
                self.abort_transfer(s, r, Code::TransferFailed);
            }
            // Late frames after P finished are dropped.
            _ => {}
        }
    }

    fn step(&self, s: &mut State, action: Action) {
        let poison = self.poison();
        match action {
            Action::Admit(r) => {
                let spec = &self.requests[r];
                let cap = s.prefill_pool.capacity_tokens();
                if check_generation(spec.prompt, spec.max_tokens, self.context_window, cap) {
                    s.p[r].phase = PPhase::Waiting;
                } else if self.bugs.placeholder
                    && check_generation(spec.prompt, spec.max_tokens, self.context_window, 255)
                {
                    // 2026: rejected for the pool, swapped for a one-token placeholder.
                    s.rejected[r] = true;
                    s.p[r].prompt = 1;
                    s.p[r].phase = PPhase::Waiting;
                } else {
                    s.rejected[r] = true;
                    Self::finish(s, r, Outcome::Error(Code::Admission));
                }
            }
            Action::Reserve(r) => {
                let pages = s.p[r].prompt;
                let reservation = s
                    .prefill_pool
                    .try_reserve(pages)
                    .expect("enabled only when it fits");
                s.p[r].phase = PPhase::Prefill(KvPool::open(self.owner(r), reservation));
            }
            Action::PrefillStep(r) => {
                let PPhase::Prefill(seq) = &mut s.p[r].phase else {
                    unreachable!()
                };
                // The new chunk attends over the prompt so far, then writes its own K/V.
                let mut reads = Vec::new();
                for &pr in &seq.table {
                    reads.push((pr.page, s.prefill_pool.read(seq.owner, pr)));
                }
                s.prefill_pool.grow(seq, 1);
                let pos = seq.len;
                let owner = seq.owner;
                let written = s.prefill_pool.write(seq, pos, Content::Kv(owner));
                seq.len += 1;
                let mut failed = written.is_err();
                for (page, c) in reads {
                    match c {
                        Ok(c) => Self::note_read(s, 'P', owner, page, c),
                        Err(Isolation) => failed = true,
                    }
                }
                if failed {
                    let PPhase::Prefill(seq) = std::mem::replace(&mut s.p[r].phase, PPhase::Done)
                    else {
                        unreachable!()
                    };
                    s.prefill_pool.release(seq, poison);
                    Self::finish(s, r, Outcome::Error(Code::Isolation));
                }
            }
            Action::Handoff(r) => {
                let PPhase::Prefill(seq) = std::mem::replace(&mut s.p[r].phase, PPhase::Done)
                else {
                    unreachable!()
                };
                let held = s.prefill_pool.hold(&seq);
                s.prefill_pool.release(seq, poison);
                let Ok(held) = held else {
                    Self::finish(s, r, Outcome::Error(Code::Isolation));
                    return;
                };
                let spec = &self.requests[r];
                // The Hello declares the request's own prompt (the original one, even for the
                // 2026 placeholder).
                s.conn[r] = Conn::Open;
                self.send_to_d(
                    s,
                    r,
                    ToDecode::Hello {
                        owner: self.owner(r),
                        prompt_len: spec.prompt,
                        token_count: spec.prompt,
                        page_count: spec.prompt,
                        max_tokens: spec.max_tokens,
                    },
                );
                s.p[r].phase = PPhase::Transfer {
                    held,
                    step: TStep::AwaitAccept,
                };
            }
            Action::SendPage(r) => {
                let PPhase::Transfer {
                    held,
                    step: TStep::Sending(n),
                } = &mut s.p[r].phase
                else {
                    unreachable!()
                };
                let pr = held[*n as usize];
                let index = *n;
                *n += 1;
                let owner = self.owner(r);
                match s.prefill_pool.read(owner, pr) {
                    Ok(content) => {
                        Self::note_read(s, 'P', owner, pr.page, content);
                        let (tag_owner, _) = s.prefill_pool.pages[pr.page as usize]
                            .tag
                            .expect("read checked the tag");
                        self.send_to_d(
                            s,
                            r,
                            ToDecode::Pages {
                                index,
                                owner: tag_owner,
                                content,
                            },
                        );
                    }
                    Err(Isolation) => self.abort_transfer(s, r, Code::Isolation),
                }
            }
            Action::SendCommit(r) => {
                let PPhase::Transfer { step, .. } = &mut s.p[r].phase else {
                    unreachable!()
                };
                *step = TStep::AwaitAck;
                let declared = self.requests[r].prompt;
                self.send_to_d(
                    s,
                    r,
                    ToDecode::Commit {
                        token_count: declared,
                        page_count: declared,
                    },
                );
            }
            Action::DeliverToDecode(r) => self.deliver_to_decode(s, r),
            Action::DeliverToPrefill(r) => self.deliver_to_prefill(s, r),
            Action::DecodeStep(r) => {
                let DPhase::Decoding { seq, max_tokens } = &mut s.d[r] else {
                    unreachable!()
                };
                // Token 1 comes from the committed logits; each further token attends over
                // every position so far and writes its own K/V.
                let mut seq = seq.clone();
                let max_tokens = *max_tokens;
                for _ in 1..max_tokens {
                    for i in 0..seq.len as usize {
                        let pr = seq.table[i];
                        match s.decode_pool.read(seq.owner, pr) {
                            Ok(c) => Self::note_read(s, 'D', seq.owner, pr.page, c),
                            Err(Isolation) => {
                                s.d[r] = DPhase::Decoding { seq, max_tokens };
                                self.decode_release(s, r);
                                Self::send_to_p(s, r, ToPrefill::Failed(Code::Isolation));
                                return;
                            }
                        }
                    }
                    s.decode_pool.grow(&mut seq, 1);
                    let pos = seq.len;
                    s.decode_pool
                        .write(&seq, pos, Content::Kv(seq.owner))
                        .expect("a just-grown page is ours");
                    seq.len += 1;
                }
                s.d[r] = DPhase::Decoding { seq, max_tokens };
                self.decode_release(s, r);
                Self::send_to_p(s, r, ToPrefill::Done);
            }
            Action::ClientDisconnect(r) => {
                s.p[r].client = false;
                match &s.p[r].phase {
                    PPhase::Arrived | PPhase::Waiting => Self::finish(s, r, Outcome::Cancelled),
                    PPhase::Prefill(_) => {
                        let PPhase::Prefill(seq) =
                            std::mem::replace(&mut s.p[r].phase, PPhase::Done)
                        else {
                            unreachable!()
                        };
                        s.prefill_pool.release(seq, poison);
                        Self::finish(s, r, Outcome::Cancelled);
                    }
                    PPhase::Transfer { held, .. } => {
                        // Not aborted midway: it completes (Ack) or rolls back first.
                        if self.bugs.unhold_on_disconnect {
                            let held = held.clone();
                            s.prefill_pool.unhold(&held, poison);
                        }
                    }
                    PPhase::Relay => Self::finish(s, r, Outcome::Cancelled),
                    PPhase::Done => unreachable!(),
                }
            }
            Action::LeaseExpiry(r) => match s.p[r].phase {
                PPhase::Transfer { .. } => self.abort_transfer(s, r, Code::Timeout),
                _ => Self::finish(s, r, Outcome::Error(Code::Timeout)),
            },
            Action::DecodeTimeout(r) => self.decode_release(s, r),
            Action::LoseToDecode(r) => {
                s.faults_left -= 1;
                s.to_d[r].pop_front();
            }
            Action::LoseToPrefill(r) => {
                s.faults_left -= 1;
                s.to_p[r].pop_front();
            }
            Action::BreakConnection(r) => {
                s.faults_left -= 1;
                s.to_d[r] = VecDeque::from([Frame::close()]);
                s.to_p[r] = VecDeque::from([ToPrefill::Close]);
                s.conn[r] = Conn::Closed;
            }
            Action::DecodeRestart => {
                s.faults_left -= 1;
                for r in 0..self.requests.len() {
                    if matches!(s.d[r], DPhase::Receiving { .. } | DPhase::Decoding { .. }) {
                        s.d[r] = DPhase::Done;
                    }
                    if s.conn[r] == Conn::Open {
                        s.to_d[r].clear();
                        s.to_p[r] = VecDeque::from([ToPrefill::Close]);
                        s.conn[r] = Conn::Closed;
                    }
                }
                // A new process: a fresh pool.
                s.decode_pool = KvPool::new(self.decode_pages, self.history());
            }
            Action::PrefillRestart => {
                s.faults_left -= 1;
                for r in 0..self.requests.len() {
                    if s.p[r].phase != PPhase::Done {
                        // The control plane sees the node's connection reset: 502.
                        let pr = &mut s.p[r];
                        pr.outcome = Some(if pr.client {
                            Outcome::Error(Code::TransferFailed)
                        } else {
                            Outcome::Cancelled
                        });
                        pr.phase = PPhase::Done;
                    }
                    if s.conn[r] == Conn::Open {
                        s.to_p[r].clear();
                        s.to_d[r] = VecDeque::from([Frame::close()]);
                        s.conn[r] = Conn::Closed;
                    }
                }
                s.prefill_pool = KvPool::new(self.prefill_pages, Content::Poison);
            }
            Action::Inject(r) => {
                s.attacks_left -= 1;
                let (index, owner) = match &s.d[r] {
                    // The attacker knows the protocol: the index and owner D expects next.
                    DPhase::Receiving { seq, received, .. } => (*received, seq.owner),
                    _ => (0, self.owner(r)),
                };
                let body = ToDecode::Pages {
                    index,
                    owner,
                    content: Content::Kv(MALLORY),
                };
                s.to_d[r].push_front(Frame { body, mac: None });
            }
            Action::Modify(r) => {
                s.attacks_left -= 1;
                if let Some(Frame {
                    body: ToDecode::Pages { content, .. },
                    ..
                }) = s.to_d[r].front_mut()
                {
                    *content = Content::Kv(MALLORY);
                }
            }
            Action::Replay(r, i) => {
                s.attacks_left -= 1;
                let frame = s.seen[i as usize].clone();
                s.to_d[r].push_front(frame);
            }
            Action::Reorder(r) => {
                s.attacks_left -= 1;
                s.to_d[r].swap(0, 1);
            }
        }
    }
}

impl Model for TransferModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let n = self.requests.len();
        vec![State {
            p: self
                .requests
                .iter()
                .map(|spec| PReq {
                    phase: PPhase::Arrived,
                    client: true,
                    outcome: None,
                    prompt: spec.prompt,
                })
                .collect(),
            d: vec![DPhase::Idle; n],
            conn: vec![Conn::Unused; n],
            to_d: vec![VecDeque::new(); n],
            tx_seq: vec![0; n],
            rx_seq: vec![0; n],
            attacks_left: self.attacks,
            seen: Vec::new(),
            to_p: vec![VecDeque::new(); n],
            prefill_pool: KvPool::new(self.prefill_pages, Content::Poison),
            decode_pool: KvPool::new(self.decode_pages, self.history()),
            faults_left: self.faults,
            rejected: vec![false; n],
            foreign_read: None,
            forged_import: None,
            forgery_refused: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for r in 0..self.requests.len() {
            let pr = &s.p[r];
            match &pr.phase {
                PPhase::Arrived => actions.push(Action::Admit(r)),
                PPhase::Waiting => {
                    let avail =
                        (s.prefill_pool.free.len() as u8).saturating_sub(s.prefill_pool.reserved);
                    if pr.prompt <= avail {
                        actions.push(Action::Reserve(r));
                    }
                }
                PPhase::Prefill(seq) => {
                    if seq.len < pr.prompt {
                        actions.push(Action::PrefillStep(r));
                    } else {
                        actions.push(Action::Handoff(r));
                    }
                }
                PPhase::Transfer { held, step } => {
                    match step {
                        TStep::Sending(n) if (*n as usize) < held.len() => {
                            actions.push(Action::SendPage(r))
                        }
                        TStep::Sending(_) => actions.push(Action::SendCommit(r)),
                        TStep::AwaitAccept | TStep::AwaitAck => {}
                    }
                    actions.push(Action::LeaseExpiry(r));
                }
                PPhase::Relay => actions.push(Action::LeaseExpiry(r)),
                PPhase::Done => {}
            }
            if pr.client && pr.outcome.is_none() {
                actions.push(Action::ClientDisconnect(r));
            }
            if !s.to_d[r].is_empty() {
                actions.push(Action::DeliverToDecode(r));
            }
            if !s.to_p[r].is_empty() {
                actions.push(Action::DeliverToPrefill(r));
            }
            match s.d[r] {
                DPhase::Decoding { .. } => actions.push(Action::DecodeStep(r)),
                DPhase::Receiving { .. } if !self.bugs.no_decode_timeout => {
                    actions.push(Action::DecodeTimeout(r))
                }
                _ => {}
            }
        }
        if s.faults_left > 0 {
            for r in 0..self.requests.len() {
                if !s.to_d[r].is_empty() {
                    actions.push(Action::LoseToDecode(r));
                }
                if !s.to_p[r].is_empty() {
                    actions.push(Action::LoseToPrefill(r));
                }
                if s.conn[r] == Conn::Open {
                    actions.push(Action::BreakConnection(r));
                }
            }
            if s.d
                .iter()
                .any(|d| matches!(d, DPhase::Receiving { .. } | DPhase::Decoding { .. }))
            {
                actions.push(Action::DecodeRestart);
            }
            if s.p.iter().any(|p| p.phase != PPhase::Done) {
                actions.push(Action::PrefillRestart);
            }
        }
        if s.attacks_left > 0 {
            // An attacker on the network between P and D, without the transfer key, while a
            // connection is open.
            for r in 0..self.requests.len() {
                if s.conn[r] != Conn::Open {
                    continue;
                }
                if matches!(s.d[r], DPhase::Receiving { .. }) {
                    actions.push(Action::Inject(r));
                }
                if matches!(
                    s.to_d[r].front(),
                    Some(Frame {
                        body: ToDecode::Pages { content, .. },
                        ..
                    }) if *content != Content::Kv(MALLORY)
                ) {
                    actions.push(Action::Modify(r));
                }
                for i in 0..s.seen.len() {
                    actions.push(Action::Replay(r, i as u8));
                }
                if s.to_d[r].len() >= 2 && s.to_d[r][0] != s.to_d[r][1] {
                    actions.push(Action::Reorder(r));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        self.step(&mut s, action);
        // No self-loops: they would hide non-termination from `eventually`.
        (s != *last).then_some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("no foreign read", |_, s: &State| s.foreign_read.is_none()),
            Property::always(
                "decode imports only what its prefill sent",
                |_, s: &State| s.forged_import.is_none(),
            ),
            Property::always("rejected never succeeds", |_, s: &State| {
                s.p.iter()
                    .zip(&s.rejected)
                    .all(|(p, &rej)| !rej || p.outcome != Some(Outcome::Success))
            }),
            Property::always("reuse only after every holder released", |_, s: &State| {
                holders_consistent(s)
            }),
            Property::always("quiescent means clean", |m: &TransferModel, s: &State| {
                !m.next_states(s).is_empty() || m.is_clean(s)
            }),
            Property::eventually(
                "every request terminates",
                |m: &TransferModel, s: &State| m.is_clean(s),
            ),
            Property::sometimes("a request succeeds", |_, s: &State| {
                s.p.iter().any(|p| p.outcome == Some(Outcome::Success))
            }),
            Property::sometimes("decode rejects, retryable", |_, s: &State| {
                s.p.iter()
                    .any(|p| p.outcome == Some(Outcome::Error(Code::Overloaded)))
            }),
            Property::sometimes("a transfer fails", |_, s: &State| {
                s.p.iter()
                    .any(|p| p.outcome == Some(Outcome::Error(Code::TransferFailed)))
            }),
            Property::sometimes("a lease expires", |_, s: &State| {
                s.p.iter()
                    .any(|p| p.outcome == Some(Outcome::Error(Code::Timeout)))
            }),
            Property::sometimes("a forged frame is refused", |_, s: &State| {
                s.forgery_refused
            }),
            Property::sometimes("a page is reused", |_, s: &State| {
                s.prefill_pool.pages.iter().any(|p| p.epoch >= 2)
                    || s.decode_pool.pages.iter().any(|p| p.epoch >= 2)
            }),
        ]
    }
}

/// Every live reference to a page (a running sequence's block table, a transfer's hold) names
/// a page that is still allocated under that epoch and not on the free list, and each page's
/// `holders` equals the number of live references to it: so a page goes back to the free list
/// (and can be re-allocated) only after every holder released it.
fn holders_consistent(s: &State) -> bool {
    let mut p_refs: Vec<PageRef> = Vec::new();
    let mut d_refs: Vec<PageRef> = Vec::new();
    for pr in &s.p {
        match &pr.phase {
            PPhase::Prefill(seq) => p_refs.extend(&seq.table),
            PPhase::Transfer { held, .. } => p_refs.extend(held),
            _ => {}
        }
    }
    for d in &s.d {
        if let DPhase::Receiving { seq, .. } | DPhase::Decoding { seq, .. } = d {
            d_refs.extend(&seq.table);
        }
    }
    let check = |pool: &KvPool, refs: &[PageRef]| {
        let live_ok = refs.iter().all(|r| {
            let p = &pool.pages[r.page as usize];
            p.allocated && p.epoch == r.epoch && !pool.free.contains(&r.page)
        });
        let counts_ok = pool.pages.iter().enumerate().all(|(i, p)| {
            let live = refs
                .iter()
                .filter(|r| r.page as usize == i && r.epoch == p.epoch)
                .count();
            (p.allocated || p.holders == 0) && (!p.allocated || p.holders as usize == live)
        });
        let free_ok = pool.free.iter().all(|&f| !pool.pages[f as usize].allocated);
        live_ok && counts_ok && free_ok
    };
    check(&s.prefill_pool, &p_refs) && check(&s.decode_pool, &d_refs)
}

// ---------------------------------------------------------------------------------------------
// Configurations and tests
// ---------------------------------------------------------------------------------------------

const A: Spec = Spec {
    tenant: 0,
    prompt: 1,
    max_tokens: 2,
};
/// Does not fit the prefill pool (2 + 2 > 3 pages) but fits the context window and the decode
/// pool: the 2026 shape.
const B: Spec = Spec {
    tenant: 1,
    prompt: 2,
    max_tokens: 2,
};
const C: Spec = Spec {
    tenant: 1,
    prompt: 1,
    max_tokens: 2,
};

fn model(requests: &[Spec], decode_pages: u8, faults: u8, bugs: Bugs) -> TransferModel {
    TransferModel {
        requests: requests.to_vec(),
        context_window: 4,
        prefill_pages: 3,
        decode_pages,
        faults,
        attacks: 0,
        bugs,
    }
}

/// `model` with a network attacker who may tamper with `attacks` frames.
fn attacked(requests: &[Spec], attacks: u8, bugs: Bugs) -> TransferModel {
    TransferModel {
        attacks,
        ..model(requests, 3, 0, bugs)
    }
}

/// Explore exhaustively (or, with `stop_at`, until that property has a discovery: the BFS
/// then reports a near-shortest counterexample).
fn check(
    model: TransferModel,
    label: &str,
    stop_at: Option<&'static str>,
) -> impl Checker<TransferModel> {
    let t = Instant::now();
    let mut builder = model.checker();
    if let Some(name) = stop_at {
        builder = builder.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    let checker = builder.spawn_bfs().join();
    eprintln!(
        "{label}: {} states ({} unique), depth {}, {:.2?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        t.elapsed()
    );
    checker
}

/// The path up to the first state that violates `name` (the checker keeps the last
/// violation it met in a block of states, not the first).
fn counterexample(m: &TransferModel, path: &Path<State, Action>, name: &'static str) -> String {
    let condition = m.property(name).condition;
    let mut actions = Vec::new();
    let mut last = None;
    for (state, action) in path.clone().into_vec() {
        if !condition(m, &state) {
            last = Some(state);
            break;
        }
        actions.extend(action);
    }
    let last = last.unwrap_or_else(|| path.last_state().clone());
    let text = format!(
        "{} steps: {}\noutcomes: {:?}\nrejected: {:?}\nforeign read: {:?}\nforged import: {:?}",
        actions.len(),
        actions
            .iter()
            .map(|a| format!("{a:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        last.p.iter().map(|p| p.outcome).collect::<Vec<_>>(),
        last.rejected,
        last.foreign_read,
        last.forged_import
    );
    eprintln!("counterexample for \"{name}\":\n{text}");
    text
}

const SAFETY: [&str; 6] = [
    "no foreign read",
    "decode imports only what its prefill sent",
    "rejected never succeeds",
    "reuse only after every holder released",
    "quiescent means clean",
    "every request terminates",
];

fn assert_safe(checker: &impl Checker<TransferModel>, examples: &[&'static str]) {
    for name in SAFETY {
        if let Some(path) = checker.discovery(name) {
            panic!(
                "{name} violated:\n{}",
                counterexample(checker.model(), &path, name)
            );
        }
    }
    for &name in examples {
        assert!(
            checker.discovery(name).is_some(),
            "vacuous bound: no example of {name}"
        );
    }
}

#[test]
fn designed_protocol_two_tenants_three_requests() {
    // B is rejected at prefill admission; A and C compete for decode's 3 pages (one of them
    // may get a retryable Reject), and the second one reuses the first one's pages.
    let m = model(&[A, B, C], 3, 0, Bugs::default());
    let checker = check(m, "designed A,B,C", None);
    assert_safe(
        &checker,
        &[
            "a request succeeds",
            "a page is reused",
            "decode rejects, retryable",
            "a lease expires",
        ],
    );
}

#[test]
fn designed_protocol_with_faults() {
    // Two admitted requests of two tenants, with one message loss, broken connection, decode
    // restart or prefill restart anywhere, besides client disconnects and lease expiries.
    let m = model(&[A, C], 3, 1, Bugs::default());
    let checker = check(m, "designed A,C + 1 fault", None);
    assert_safe(
        &checker,
        &[
            "a request succeeds",
            "a page is reused",
            "a transfer fails",
            "a lease expires",
        ],
    );
}

#[test]
fn designed_protocol_rejected_request_with_faults() {
    let m = model(&[A, B], 4, 2, Bugs::default());
    let checker = check(m, "designed A,B + 2 faults", None);
    assert_safe(&checker, &["a request succeeds", "a transfer fails"]);
}

#[test]
fn placeholder_alone_is_caught_by_decode_verification() {
    let bugs = Bugs {
        placeholder: true,
        ..Bugs::default()
    };
    let checker = check(
        model(&[A, B], 4, 1, bugs),
        "placeholder only + 1 fault",
        None,
    );
    assert_safe(&checker, &["a request succeeds"]);
}

#[test]
fn the_2026_bug_lets_a_rejected_request_succeed() {
    let bugs = Bugs {
        placeholder: true,
        trust_declared_length: true,
        ..Bugs::default()
    };
    // Exhaustively: poisoning and owner tags still keep other tenants' data out (B attends
    // over NaN), but the rejected request gets a 200.
    let checker = check(
        model(&[A, B], 4, 0, bugs.clone()),
        "2026 bug, poisoned",
        None,
    );
    assert!(checker.discovery("no foreign read").is_none());
    assert!(checker.discovery("rejected never succeeds").is_some());
    // The shortest counterexample.
    let name = "rejected never succeeds";
    let checker = check(model(&[A, B], 4, 0, bugs), "2026 bug, poisoned", Some(name));
    let path = checker
        .discovery(name)
        .expect("the model must find the 2026 bug");
    let text = counterexample(checker.model(), &path, name);
    assert!(text.contains("Commit"), "{text}");
}

#[test]
fn the_2026_bug_on_an_unpoisoned_pool_leaks_another_tenants_kv() {
    let bugs = Bugs {
        placeholder: true,
        trust_declared_length: true,
        no_poison: true,
        ..Bugs::default()
    };
    let name = "no foreign read";
    let checker = check(
        model(&[A, B], 4, 0, bugs),
        "2026 bug, unpoisoned",
        Some(name),
    );
    let path = checker
        .discovery(name)
        .expect("the model must find the cross-tenant read");
    counterexample(checker.model(), &path, name);
    let (node, reader, _) = path.last_state().foreign_read.expect("a foreign read");
    assert_eq!(node, 'D');
    assert_eq!(reader.tenant, 1, "the rejected request reads stale pages");
}

#[test]
fn unhold_on_client_disconnect_frees_pages_a_transfer_still_holds() {
    let bugs = Bugs {
        unhold_on_disconnect: true,
        ..Bugs::default()
    };
    let name = "reuse only after every holder released";
    let checker = check(
        model(&[A, C], 3, 0, bugs),
        "unhold on disconnect",
        Some(name),
    );
    let path = checker
        .discovery(name)
        .expect("the model must find the early release");
    counterexample(checker.model(), &path, name);
}

#[test]
fn decode_without_idle_timeout_pins_pages_after_a_lost_close() {
    let bugs = Bugs {
        no_decode_timeout: true,
        ..Bugs::default()
    };
    let checker = check(model(&[A], 3, 1, bugs), "no decode timeout", None);
    let name = "quiescent means clean";
    let path = checker
        .discovery(name)
        .expect("the model must find pinned decode pages");
    counterexample(checker.model(), &path, name);
    assert!(checker.discovery("every request terminates").is_some());
}

#[test]
fn designed_protocol_against_a_network_attacker() {
    // Two tenants' transfers; an attacker without the transfer key injects its own page,
    // rewrites a page in flight, replays any frame it has seen (from either transfer) or
    // swaps two frames, anywhere. Every tampered frame is refused before it is used, and
    // every request still ends with both pools full.
    let checker = check(
        attacked(&[A, C], 1, Bugs::default()),
        "designed A,C + 1 attack",
        None,
    );
    assert_safe(
        &checker,
        &[
            "a request succeeds",
            "a forged frame is refused",
            "a transfer fails",
        ],
    );
    // Two tampered frames on one transfer (a replay after an injection, and so on).
    let checker = check(
        attacked(&[A], 2, Bugs::default()),
        "designed A + 2 attacks",
        None,
    );
    assert_safe(
        &checker,
        &[
            "a request succeeds",
            "a forged frame is refused",
            "a transfer fails",
        ],
    );
}

#[test]
fn without_the_mac_an_attacker_puts_its_kv_into_another_tenants_request() {
    let bugs = Bugs {
        no_mac: true,
        ..Bugs::default()
    };
    let name = "decode imports only what its prefill sent";
    let checker = check(attacked(&[A], 1, bugs.clone()), "no MAC", Some(name));
    let path = checker
        .discovery(name)
        .expect("the model must find the injected page");
    let text = counterexample(checker.model(), &path, name);
    assert!(text.contains("Inject") || text.contains("Modify"), "{text}");
    // And the victim then attends over the attacker's K/V.
    let name = "no foreign read";
    let checker = check(attacked(&[A], 1, bugs), "no MAC", Some(name));
    let path = checker
        .discovery(name)
        .expect("the victim must read the attacker's K/V");
    counterexample(checker.model(), &path, name);
    let (node, reader, _) = path.last_state().foreign_read.expect("a foreign read");
    assert_eq!((node, reader.tenant), ('D', A.tenant));
}

#[test]
fn without_the_nonce_a_recorded_transfer_replays_into_another_connection() {
    let bugs = Bugs {
        no_nonce: true,
        ..Bugs::default()
    };
    let name = "decode imports only what its prefill sent";
    let checker = check(attacked(&[A, C], 1, bugs), "no nonce", Some(name));
    let path = checker
        .discovery(name)
        .expect("the model must find the replayed Hello");
    let text = counterexample(checker.model(), &path, name);
    assert!(text.contains("Replay"), "{text}");
}
