//! One request's sandbox: the store data of a worker instance, its resource limiter, and the
//! clock of guest execution time that the epoch callback checks against the CPU limit.
//!
//! The guest gets no preopened directories, no environment variables, no arguments, no
//! inherited stdio (its stdout/stderr go to a bounded buffer that is logged), no sockets
//! (wasmtime-wasi's default context allows no address and no name lookup) and no outgoing
//! HTTP (`send_request` is denied). Clocks and randomness are allowed.

use std::time::{Duration, Instant};

use wasmtime::component::ResourceTable;
use wasmtime::{CallHook, ResourceLimiter, StoreContextMut, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

use super::ai::AiCtx;

/// Which sandbox limit stopped a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Cpu,
    Wall,
    Memory,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::Cpu => "CPU time limit exceeded",
            Limit::Wall => "wall-clock time limit exceeded",
            Limit::Memory => "memory limit exceeded",
        })
    }
}

impl std::error::Error for Limit {}

/// Bytes of a guest's stdout and stderr kept for the log, each.
const OUTPUT_CAPTURE_BYTES: usize = 16 << 10;

/// Largest table a guest may grow to (SpiderMonkey's function table is a few thousand).
const MAX_TABLE_ELEMENTS: usize = 1 << 20;

/// What one table element counts against the memory limit.
const TABLE_ELEMENT_BYTES: usize = std::mem::size_of::<usize>();

/// Guest execution time: wall time spent in WebAssembly, host calls excluded (a call to
/// `AI.run` or a wait on a timer or stream does not count).
#[derive(Debug)]
pub struct GuestClock {
    since: Option<Instant>,
    used: Duration,
    pub limit: Duration,
    /// `used` when the guest last yielded its thread at an epoch deadline.
    used_at_yield: Duration,
}

impl GuestClock {
    fn new(limit: Duration) -> Self {
        GuestClock {
            since: None,
            used: Duration::ZERO,
            limit,
            used_at_yield: Duration::ZERO,
        }
    }

    pub fn used(&self) -> Duration {
        self.used + self.since.map_or(Duration::ZERO, |s| s.elapsed())
    }

    fn enter_guest(&mut self) {
        if self.since.is_none() {
            self.since = Some(Instant::now());
        }
    }

    fn leave_guest(&mut self) {
        if let Some(s) = self.since.take() {
            self.used += s.elapsed();
        }
    }
}

/// A deny-everything `wasi:http` hook set: no outgoing requests.
pub struct DenyOutgoing;

impl WasiHttpHooks for DenyOutgoing {
    fn send_request(
        &mut self,
        _request: http::Request<wasmtime_wasi_http::WasiBody>,
        _options: Option<wasmtime_wasi_http::RequestOptions>,
        _fut: Box<dyn Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
    ) -> Box<
        dyn Future<
                Output = Result<
                    (
                        http::Response<wasmtime_wasi_http::WasiBody>,
                        Box<dyn Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
                    ),
                    wasmtime_wasi_http::Error,
                >,
            > + Send,
    > {
        Box::new(async { Err(wasmtime_wasi_http::Error::HttpRequestDenied) })
    }
}

/// The bytes an instance may hold in all its linear memories and tables together. A
/// component has several core instances, each with its own memories, all in one store: a
/// limit checked per memory would let it hold several times its `memory_mib`.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    used: usize,
}

impl MemoryBudget {
    pub fn new(limit: usize) -> Self {
        MemoryBudget { limit, used: 0 }
    }

    /// One memory or table growing from `current` to `desired` bytes (a new one from 0).
    /// A growth that then fails for another reason stays counted: the budget errs on the
    /// side of refusing.
    pub fn grow(&mut self, current: usize, desired: usize) -> Result<(), Limit> {
        let total = self.used.saturating_sub(current).saturating_add(desired);
        if total > self.limit {
            return Err(Limit::Memory);
        }
        self.used = total;
        Ok(())
    }
}

/// The `T` of a worker's `Store<T>`.
pub struct WorkerState {
    wasi: WasiCtx,
    http: WasiHttpCtx,
    hooks: DenyOutgoing,
    table: ResourceTable,
    pub ai: AiCtx,
    pub clock: GuestClock,
    memory: MemoryBudget,
    /// The first limit the request ran into, if any.
    pub limit_hit: Option<Limit>,
    stdout: MemoryOutputPipe,
    stderr: MemoryOutputPipe,
}

impl WorkerState {
    pub fn new(ai: AiCtx, cpu: Duration, memory_limit: usize) -> Self {
        let stdout = MemoryOutputPipe::new(OUTPUT_CAPTURE_BYTES);
        let stderr = MemoryOutputPipe::new(OUTPUT_CAPTURE_BYTES);
        let wasi = WasiCtx::builder()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .build();
        WorkerState {
            wasi,
            http: WasiHttpCtx::new(),
            hooks: DenyOutgoing,
            table: ResourceTable::new(),
            ai,
            clock: GuestClock::new(cpu),
            memory: MemoryBudget::new(memory_limit),
            limit_hit: None,
            stdout,
            stderr,
        }
    }

    /// What the guest wrote to stdout and stderr (bounded), for the log.
    pub fn output(&self) -> (String, String) {
        let s = |p: &MemoryOutputPipe| String::from_utf8_lossy(&p.contents()).into_owned();
        (s(&self.stdout), s(&self.stderr))
    }

    /// A memory or table growing from `current` to `desired` bytes: accounted, or a trap
    /// with the memory limit (not a failed `memory.grow`: the request ends at once with its
    /// own error instead of leaving the guest to limp on without memory).
    fn grow(&mut self, current: usize, desired: usize) -> wasmtime::Result<bool> {
        match self.memory.grow(current, desired) {
            Ok(()) => Ok(true),
            Err(l) => Err(self.hit(l)),
        }
    }

    fn hit(&mut self, l: Limit) -> wasmtime::Error {
        self.limit_hit.get_or_insert(l);
        wasmtime::Error::new(l)
    }
}

impl WasiView for WorkerState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for WorkerState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: &mut self.hooks,
        }
    }
}

impl WorkerState {
    pub fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
    }
}

impl ResourceLimiter for WorkerState {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.grow(current, desired)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > MAX_TABLE_ELEMENTS {
            return Err(self.hit(Limit::Memory));
        }
        // Elements, not bytes: each costs the host about a pointer.
        self.grow(current * TABLE_ELEMENT_BYTES, desired * TABLE_ELEMENT_BYTES)
    }

    fn instances(&self) -> usize {
        64
    }

    fn memories(&self) -> usize {
        16
    }

    fn tables(&self) -> usize {
        64
    }
}

/// Keeps the guest clock: in WebAssembly from a call into it (or a return from a host call)
/// until it returns (or calls the host).
pub fn call_hook(
    mut store: StoreContextMut<'_, WorkerState>,
    hook: CallHook,
) -> wasmtime::Result<()> {
    let clock = &mut store.data_mut().clock;
    match hook {
        CallHook::CallingWasm | CallHook::ReturningFromHost => clock.enter_guest(),
        CallHook::ReturningFromWasm | CallHook::CallingHost => clock.leave_guest(),
    }
    Ok(())
}

/// Runs at every epoch deadline while the guest executes: a trap once its execution time is
/// over the limit; otherwise a new deadline at about when the limit would be reached, with
/// a yield to the executor first if the guest has executed for a tick or more since it last
/// yielded (so a busy guest never holds a thread). A deadline that passed while the guest
/// waited on the host (an `AI.run`, say) is no reason to yield: it was not running.
pub fn epoch_deadline(
    mut store: StoreContextMut<'_, WorkerState>,
    tick: Duration,
) -> wasmtime::Result<UpdateDeadline> {
    let state = store.data_mut();
    let used = state.clock.used();
    if used >= state.clock.limit {
        return Err(state.hit(Limit::Cpu));
    }
    let left = state.clock.limit - used;
    let ticks = (left.as_nanos() / tick.as_nanos().max(1)).clamp(1, 10) as u64;
    if used - state.clock.used_at_yield < tick {
        return Ok(UpdateDeadline::Continue(ticks));
    }
    state.clock.used_at_yield = used;
    Ok(UpdateDeadline::Yield(ticks))
}

#[cfg(test)]
mod tests {
    use super::{Limit, MemoryBudget};
    use wasmtime::{Config, Engine, Instance, Module, ResourceLimiter, Store};

    /// A store's limiter made of the worker's memory budget alone.
    struct Budgeted(MemoryBudget);

    impl ResourceLimiter for Budgeted {
        fn memory_growing(
            &mut self,
            c: usize,
            d: usize,
            _: Option<usize>,
        ) -> wasmtime::Result<bool> {
            self.0
                .grow(c, d)
                .map(|()| true)
                .map_err(wasmtime::Error::new)
        }
        fn table_growing(
            &mut self,
            _: usize,
            _: usize,
            _: Option<usize>,
        ) -> wasmtime::Result<bool> {
            Ok(true)
        }
    }

    /// Four memories, each grown by 24 MiB: each under a 64 MiB limit, together over it.
    #[test]
    fn the_memory_limit_is_the_total_of_every_memory() {
        let mut config = Config::new();
        config.wasm_multi_memory(true);
        let engine = Engine::new(&config).unwrap();
        let module = Module::new(
            &engine,
            wat::parse_str(
                r#"(module
                  (memory $a 1) (memory $b 0) (memory $c 0) (memory $d 0)
                  (func (export "grow") (param i32) (result i32)
                    (drop (memory.grow $a (local.get 0)))
                    (drop (memory.grow $b (local.get 0)))
                    (drop (memory.grow $c (local.get 0)))
                    (memory.grow $d (local.get 0))))"#,
            )
            .unwrap(),
        )
        .unwrap();
        let run = |pages: i32| {
            let mut store = Store::new(&engine, Budgeted(MemoryBudget::new(64 << 20)));
            store.limiter(|b| b);
            let instance = Instance::new(&mut store, &module, &[]).unwrap();
            let grow = instance
                .get_typed_func::<i32, i32>(&mut store, "grow")
                .unwrap();
            grow.call(&mut store, pages)
        };
        // 4 x 15 MiB (+ the first memory's page) fits in 64 MiB.
        assert!(run(240).is_ok());
        // 4 x 24 MiB does not, though every memory alone is under the limit.
        let err = run(384).unwrap_err();
        assert_eq!(err.downcast_ref::<Limit>(), Some(&Limit::Memory), "{err:?}");
    }

    #[test]
    fn shrinking_nothing_and_regrowing_are_accounted_once() {
        let mut b = MemoryBudget::new(100);
        b.grow(0, 60).unwrap();
        // The same memory growing again counts its new size, not both.
        b.grow(60, 90).unwrap();
        assert_eq!(b.grow(0, 20), Err(Limit::Memory));
        b.grow(0, 10).unwrap();
        assert_eq!(b.grow(usize::MAX, usize::MAX), Err(Limit::Memory));
    }
}
