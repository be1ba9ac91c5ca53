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
    /// With the `cuda` feature on a machine with a GPU: candle's CUDA backend (cuBLAS for the
    /// matmul, candle's own kernels for the rest) gives what the CPU gives, through the ops
    /// the BERT encoder uses. Without a GPU there is nothing to compare, and the test says so.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_cuda_device_computes_what_the_cpu_does() {
        use candle_core::{Device, Tensor};
        let gpu = super::select().unwrap();
        if gpu.is_cpu() {
            eprintln!("built with cuda but no CUDA device here: nothing to compare");
            return;
        }
        let a = Tensor::randn(0f32, 1.0, (64, 384), &Device::Cpu).unwrap();
        let b = Tensor::randn(0f32, 1.0, (384, 96), &Device::Cpu).unwrap();
        let on = |d: &Device| -> Vec<f32> {
            let (a, b) = (a.to_device(d).unwrap(), b.to_device(d).unwrap());
            let y = candle_nn::ops::softmax_last_dim(&a.matmul(&b).unwrap().gelu().unwrap());
            y.unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        let (cpu, cuda) = (on(&Device::Cpu), on(&gpu));
        let diff = cpu
            .iter()
            .zip(&cuda)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-3, "CUDA and CPU differ by {diff}");
    }

    #[test]
    fn discovery_never_fails_without_a_gpu() {
        // On a machine without CUDA this is empty; with one it lists real devices. Either
        // way it returns instead of panicking, and free memory never exceeds total.
        for g in super::discover_gpus() {
            assert!(g.free_bytes <= g.total_bytes, "{g:?}");
        }
    }
}
