//! A hand-written WAT worker: one core module, wrapped into a component of the
//! `bulkhead:ai/worker` world (../wit) by wit-component. The first character of the request
//! path picks what it does:
//!
//! - `o`: 200 `ok <n>`, where `n` counts the requests this instance has seen, in a global and
//!   in two places of its linear memory (always 1 when every request gets a fresh instance)
//! - `l`: loops forever (CPU time limit)
//! - `m`: grows its memory 16 MiB at a time until that fails, then 200 `survived`
//! - `t`: traps (`unreachable`)
//! - `n`: returns without a response
//! - `s`: waits 60 s on a host timer (no CPU; the wall-clock limit)
//! - `w`: answers 200 at once, then waits 5 ms on a host timer before it returns (work
//!   after the response, holding its instance)
//! - `b`: streams a body of `BIG` bytes, no content-length
//! - `c`: declares `content-length: 999999999`, then writes 2 bytes
//! - `a`: calls `AI.run(MODEL, INPUTS, OPTIONS)` `CALLS` times and answers the last result:
//!   200 with the JSON output, or the error's status with `<code>:<message>`
//! - `r`: calls `AI.run-stream(MODEL, INPUTS, OPTIONS)` and streams its bytes (200), or
//!   answers the error as `a` does
//! - `e`: 200 with the request body echoed (up to 64 KiB)

/// What the `a` and `r` paths call.
pub struct Ai<'a> {
    pub model: &'a str,
    pub inputs: &'a str,
    pub options: &'a str,
    pub calls: u32,
}

pub const BIG: u32 = 200 * 1024;

fn data(s: &str) -> String {
    s.bytes().map(|b| format!("\\{b:02x}")).collect()
}

pub fn wat(ai: &Ai) -> String {
    let model_len = ai.model.len();
    let inputs_len = ai.inputs.len();
    let options_len = ai.options.len();
    let calls = ai.calls;
    let model = data(ai.model);
    let inputs = data(ai.inputs);
    let options = data(ai.options);
    format!(
        r#"(module
  (import "wasi:http/types@0.2.10" "[constructor]fields" (func $fields_new (result i32)))
  (import "wasi:http/types@0.2.10" "[method]fields.append"
    (func $fields_append (param i32 i32 i32 i32 i32 i32)))
  (import "wasi:http/types@0.2.10" "[constructor]outgoing-response"
    (func $resp_new (param i32) (result i32)))
  (import "wasi:http/types@0.2.10" "[method]outgoing-response.set-status-code"
    (func $set_status (param i32 i32) (result i32)))
  (import "wasi:http/types@0.2.10" "[method]outgoing-response.body"
    (func $resp_body (param i32 i32)))
  (import "wasi:http/types@0.2.10" "[method]outgoing-body.write"
    (func $body_write (param i32 i32)))
  (import "wasi:http/types@0.2.10" "[static]outgoing-body.finish"
    (func $body_finish (param i32 i32 i32 i32)))
  (import "wasi:http/types@0.2.10" "[static]response-outparam.set"
    (func $outparam_set (param i32 i32 i32 i32 i64 i32 i32 i32 i32)))
  (import "wasi:http/types@0.2.10" "[method]incoming-request.path-with-query"
    (func $path (param i32 i32)))
  (import "wasi:http/types@0.2.10" "[method]incoming-request.consume"
    (func $consume (param i32 i32)))
  (import "wasi:http/types@0.2.10" "[method]incoming-body.stream"
    (func $body_stream (param i32 i32)))
  (import "wasi:http/types@0.2.10" "[resource-drop]incoming-request"
    (func $drop_request (param i32)))
  (import "wasi:io/streams@0.2.10" "[method]output-stream.blocking-write-and-flush"
    (func $write (param i32 i32 i32 i32)))
  (import "wasi:io/streams@0.2.10" "[method]input-stream.blocking-read"
    (func $read (param i32 i64 i32)))
  (import "wasi:io/streams@0.2.10" "[resource-drop]output-stream"
    (func $drop_output (param i32)))
  (import "wasi:clocks/monotonic-clock@0.2.10" "subscribe-duration"
    (func $subscribe (param i64) (result i32)))
  (import "wasi:io/poll@0.2.10" "[method]pollable.block" (func $block (param i32)))
  (import "bulkhead:ai/ai@0.1.0" "run"
    (func $ai_run (param i32 i32 i32 i32 i32 i32 i32)))
  (import "bulkhead:ai/ai@0.1.0" "run-stream"
    (func $ai_run_stream (param i32 i32 i32 i32 i32 i32 i32)))
  (import "bulkhead:ai/ai@0.1.0" "[method]ai-stream.read" (func $ai_read (param i32 i32)))

  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 0x10000))
  (global $seen (mut i32) (i32.const 0))

  ;; 0..64: return areas; 1024: constants; 4096: scratch for answers.
  (data (i32.const 1024) "content-length")
  (data (i32.const 1040) "999999999")
  (data (i32.const 1056) "ok survived")
  (data (i32.const 2048) "{model}")
  (data (i32.const 2560) "{inputs}")
  (data (i32.const 3584) "{options}")

  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $p i32)
    ;; align up, then bump; grow the memory when the heap runs past it
    (local.set $p (i32.and (i32.add (global.get $heap) (i32.sub (local.get 2) (i32.const 1)))
                           (i32.sub (i32.const 0) (local.get 2))))
    (global.set $heap (i32.add (local.get $p) (local.get 3)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.shr_u (i32.sub (global.get $heap)
        (i32.mul (memory.size) (i32.const 65536))) (i32.const 16)) (i32.const 1))))))
    (local.get $p))

  ;; Writes the decimal of $n at $dst; returns its length.
  (func $itoa (param $n i32) (param $dst i32) (result i32)
    (local $len i32) (local $t i32) (local $i i32)
    (local.set $t (local.get $n))
    (loop $count
      (local.set $len (i32.add (local.get $len) (i32.const 1)))
      (local.set $t (i32.div_u (local.get $t) (i32.const 10)))
      (br_if $count (i32.ne (local.get $t) (i32.const 0))))
    (local.set $i (local.get $len))
    (loop $digits
      (local.set $i (i32.sub (local.get $i) (i32.const 1)))
      (i32.store8 (i32.add (local.get $dst) (local.get $i))
        (i32.add (i32.const 48) (i32.rem_u (local.get $n) (i32.const 10))))
      (local.set $n (i32.div_u (local.get $n) (i32.const 10)))
      (br_if $digits (i32.ne (local.get $i) (i32.const 0))))
    (local.get $len))

  ;; Sets the response (status, optional content-length) and returns its body's stream
  ;; handle; the outgoing-body handle is left at 48.
  (func $start (param $out i32) (param $status i32) (param $declare i32) (result i32)
    (local $fields i32) (local $resp i32)
    (local.set $fields (call $fields_new))
    (if (local.get $declare)
      (then (call $fields_append (local.get $fields) (i32.const 1024) (i32.const 14)
        (i32.const 1040) (i32.const 9) (i32.const 0))))
    (local.set $resp (call $resp_new (local.get $fields)))
    (drop (call $set_status (local.get $resp) (local.get $status)))
    (call $resp_body (local.get $resp) (i32.const 0))
    (i32.store (i32.const 48) (i32.load (i32.const 4)))
    (call $outparam_set (local.get $out) (i32.const 0) (local.get $resp)
      (i32.const 0) (i64.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0))
    (call $body_write (i32.load (i32.const 48)) (i32.const 0))
    (i32.load (i32.const 4)))

  ;; Writes $len bytes from $ptr in chunks of at most 4096.
  (func $write_all (param $stream i32) (param $ptr i32) (param $len i32)
    (local $n i32)
    (block $done
      (loop $more
        (br_if $done (i32.eqz (local.get $len)))
        (local.set $n (select (i32.const 4096) (local.get $len)
          (i32.gt_u (local.get $len) (i32.const 4096))))
        (call $write (local.get $stream) (local.get $ptr) (local.get $n) (i32.const 0))
        (if (i32.load8_u (i32.const 0)) (then unreachable))
        (local.set $ptr (i32.add (local.get $ptr) (local.get $n)))
        (local.set $len (i32.sub (local.get $len) (local.get $n)))
        (br $more))))

  (func $finish (param $stream i32)
    (call $drop_output (local.get $stream))
    (call $body_finish (i32.load (i32.const 48)) (i32.const 0) (i32.const 0) (i32.const 0)))

  (func $respond (param $out i32) (param $status i32) (param $ptr i32) (param $len i32)
    (local $s i32)
    (local.set $s (call $start (local.get $out) (local.get $status) (i32.const 0)))
    (call $write_all (local.get $s) (local.get $ptr) (local.get $len))
    (call $finish (local.get $s)))

  ;; Answers an ai-error left at 0 (status at 4, code at 8, message at 12/16).
  (func $respond_error (param $out i32)
    (local $n i32)
    (local.set $n (call $itoa (i32.load (i32.const 8)) (i32.const 4096)))
    (i32.store8 (i32.add (i32.const 4096) (local.get $n)) (i32.const 58))
    (memory.copy (i32.add (i32.const 4097) (local.get $n)) (i32.load (i32.const 12))
      (i32.load (i32.const 16)))
    (call $respond (local.get $out) (i32.load16_u (i32.const 4)) (i32.const 4096)
      (i32.add (i32.add (local.get $n) (i32.const 1)) (i32.load (i32.const 16)))))

  (func (export "wasi:http/incoming-handler@0.2.10#handle") (param $req i32) (param $out i32)
    (local $c i32) (local $i i32) (local $s i32) (local $in i32) (local $len i32)
    (global.set $seen (i32.add (global.get $seen) (i32.const 1)))
    (call $path (local.get $req) (i32.const 0))
    (if (i32.and (i32.load8_u (i32.const 0)) (i32.gt_u (i32.load (i32.const 8)) (i32.const 1)))
      (then (local.set $c (i32.load8_u (i32.add (i32.load (i32.const 4)) (i32.const 1))))))
    (if (i32.eq (local.get $c) (i32.const 101)) ;; e: echo the body
      (then
        (call $consume (local.get $req) (i32.const 0))
        (call $body_stream (i32.load (i32.const 4)) (i32.const 0))
        (local.set $in (i32.load (i32.const 4)))
        (call $read (local.get $in) (i64.const 65536) (i32.const 0))
        (if (i32.load8_u (i32.const 0))
          (then (local.set $len (i32.const 0)))
          (else (local.set $len (i32.load (i32.const 8)))))
        (call $respond (local.get $out) (i32.const 200) (i32.load (i32.const 4))
          (local.get $len))
        (return)))
    (call $drop_request (local.get $req))
    (if (i32.eq (local.get $c) (i32.const 111)) ;; o
      (then
        ;; Count in the global, in a page of the memory image and in a page past it; answer
        ;; the largest count, so state left by an earlier request anywhere shows.
        (i32.store (i32.const 1052) (i32.add (i32.load (i32.const 1052)) (i32.const 1)))
        (i32.store (i32.const 120000) (i32.add (i32.load (i32.const 120000)) (i32.const 1)))
        (local.set $i (global.get $seen))
        (if (i32.gt_u (i32.load (i32.const 1052)) (local.get $i))
          (then (local.set $i (i32.load (i32.const 1052)))))
        (if (i32.gt_u (i32.load (i32.const 120000)) (local.get $i))
          (then (local.set $i (i32.load (i32.const 120000)))))
        (i32.store8 (i32.const 4096) (i32.const 111))
        (i32.store8 (i32.const 4097) (i32.const 107))
        (i32.store8 (i32.const 4098) (i32.const 32))
        (call $respond (local.get $out) (i32.const 200) (i32.const 4096)
          (i32.add (i32.const 3) (call $itoa (local.get $i) (i32.const 4099))))
        (return)))
    (if (i32.eq (local.get $c) (i32.const 108)) ;; l
      (then (loop $forever (br $forever))))
    (if (i32.eq (local.get $c) (i32.const 109)) ;; m
      (then
        (loop $grow
          (br_if $grow (i32.ne (memory.grow (i32.const 256)) (i32.const -1))))
        (call $respond (local.get $out) (i32.const 200) (i32.const 1059) (i32.const 8))
        (return)))
    (if (i32.eq (local.get $c) (i32.const 116)) ;; t
      (then unreachable))
    (if (i32.eq (local.get $c) (i32.const 110)) ;; n
      (then (return)))
    (if (i32.eq (local.get $c) (i32.const 119)) ;; w
      (then
        (call $respond (local.get $out) (i32.const 200) (i32.const 1056) (i32.const 2))
        (call $block (call $subscribe (i64.const 5000000)))
        (return)))
    (if (i32.eq (local.get $c) (i32.const 115)) ;; s
      (then (call $block (call $subscribe (i64.const 60000000000)))
        (call $respond (local.get $out) (i32.const 200) (i32.const 1056) (i32.const 2))
        (return)))
    (if (i32.eq (local.get $c) (i32.const 98)) ;; b
      (then
        (local.set $s (call $start (local.get $out) (i32.const 200) (i32.const 0)))
        (local.set $i (i32.const 0))
        (loop $more
          (call $write_all (local.get $s) (i32.const 8192) (i32.const 4096))
          (local.set $i (i32.add (local.get $i) (i32.const 4096)))
          (br_if $more (i32.lt_u (local.get $i) (i32.const {BIG}))))
        (call $finish (local.get $s))
        (return)))
    (if (i32.eq (local.get $c) (i32.const 99)) ;; c
      (then
        (local.set $s (call $start (local.get $out) (i32.const 200) (i32.const 1)))
        (call $write_all (local.get $s) (i32.const 1056) (i32.const 2))
        (call $finish (local.get $s))
        (return)))
    (if (i32.eq (local.get $c) (i32.const 97)) ;; a
      (then
        (local.set $i (i32.const 0))
        (loop $again
          (call $ai_run (i32.const 2048) (i32.const {model_len}) (i32.const 2560)
            (i32.const {inputs_len}) (i32.const 3584) (i32.const {options_len}) (i32.const 0))
          (local.set $i (i32.add (local.get $i) (i32.const 1)))
          (br_if $again (i32.lt_u (local.get $i) (i32.const {calls}))))
        (if (i32.load8_u (i32.const 0))
          (then (call $respond_error (local.get $out)))
          (else (call $respond (local.get $out) (i32.const 200) (i32.load (i32.const 4))
            (i32.load (i32.const 8)))))
        (return)))
    (if (i32.eq (local.get $c) (i32.const 114)) ;; r
      (then
        (call $ai_run_stream (i32.const 2048) (i32.const {model_len}) (i32.const 2560)
          (i32.const {inputs_len}) (i32.const 3584) (i32.const {options_len}) (i32.const 0))
        (if (i32.load8_u (i32.const 0))
          (then (call $respond_error (local.get $out)) (return)))
        (local.set $in (i32.load (i32.const 4)))
        (local.set $s (call $start (local.get $out) (i32.const 200) (i32.const 0)))
        (block $end
          (loop $chunk
            (call $ai_read (local.get $in) (i32.const 16))
            (br_if $end (i32.eqz (i32.load8_u (i32.const 16))))
            (call $write_all (local.get $s) (i32.load (i32.const 20)) (i32.load (i32.const 24)))
            (br $chunk)))
        (call $finish (local.get $s))
        (return)))
    (call $respond (local.get $out) (i32.const 404) (i32.const 1056) (i32.const 2)))
)"#
    )
}

/// The WAT worker as a component of the worker world.
pub fn component(ai: &Ai) -> Vec<u8> {
    let mut core = wat::parse_str(wat(ai)).expect("the WAT parses");
    let mut resolve = wit_parser::Resolve::default();
    let wit = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../wit");
    let (pkg, _) = resolve.push_dir(&wit).expect("the worker WIT");
    let world = resolve
        .select_world(&[pkg], Some("worker"))
        .expect("the worker world");
    wit_component::embed_component_metadata(
        &mut core,
        &resolve,
        world,
        wit_component::StringEncoding::UTF8,
    )
    .expect("embedding the world");
    wit_component::ComponentEncoder::default()
        .module(&core)
        .expect("the core module fits the world")
        .validate(true)
        .encode()
        .expect("encoding the component")
}

/// A component that exports nothing.
pub fn no_handler() -> Vec<u8> {
    wat::parse_str("(component)").unwrap()
}

/// A component that imports an interface the host does not provide.
pub fn foreign_import() -> Vec<u8> {
    wat::parse_str(
        r#"(component
  (import "acme:secret/files@1.0.0" (instance (export "read" (func (param "path" string) (result string)))))
)"#,
    )
    .unwrap()
}
