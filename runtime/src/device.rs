//! Devices: which one runs the models, and which GPUs this machine has.
//!
//! GPU discovery goes through cudarc's driver API, loaded dynamically, so the default
//! build neither needs CUDA to build nor to run: without a driver it finds no GPU. Models
//! run on the CPU unless the `cuda` feature is on and a CUDA device exists.

use candle_core::Device;

/// A GPU as discovery sees it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_bytes: usize,
    pub free_bytes: usize,
}

/// Every CUDA device with its free memory; empty when there is no driver or no device.
pub fn discover_gpus() -> Vec<GpuInfo> {
    #[cfg(not(feature = "cuda"))]
    {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Vec::new();
        }
    }
    // cudarc panics if a symbol is missing from an unusual driver; never let that take the
    // node down.
    std::panic::catch_unwind(probe).unwrap_or_else(|_| {
        tracing::warn!("CUDA driver present but unusable; no GPU used");
        Vec::new()
    })
}

fn probe() -> Vec<GpuInfo> {
    use cudarc::driver::CudaContext;
    let count = match CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) => {
            tracing::info!("no usable CUDA driver: {e}");
            return Vec::new();
        }
    };
    (0..count)
        .filter_map(|ordinal| {
            let ctx = CudaContext::new(ordinal).ok()?;
            let (free_bytes, total_bytes) = ctx.mem_get_info().ok()?;
            Some(GpuInfo {
                ordinal,
                name: ctx.name().unwrap_or_default(),
                total_bytes,
                free_bytes,
            })
        })
        .collect()
}

/// The device models run on: CUDA device 0 with the `cuda` feature when one exists, else
/// the CPU.
pub fn select() -> anyhow::Result<Device> {
    #[cfg(feature = "cuda")]
    {
        if let Ok(d) = Device::new_cuda(0) {
            tracing::info!("models run on CUDA device 0");
            return Ok(d);
        }
        tracing::warn!("built with cuda but no CUDA device found; models run on the CPU");
    }
    Ok(Device::Cpu)
}

/// A device as operators name it: `cpu`, `cuda:0`.
pub fn name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn discovery_never_fails_without_a_gpu() {
        // On a machine without CUDA this is empty; with one it lists real devices. Either
        // way it returns instead of panicking, and free memory never exceeds total.
        for g in super::discover_gpus() {
            assert!(g.free_bytes <= g.total_bytes, "{g:?}");
        }
    }
}
