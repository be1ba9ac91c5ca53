//! Device selection. CPU by default; with the `cuda` feature, the first CUDA device.

use candle_core::Device;

pub fn select() -> anyhow::Result<Device> {
    #[cfg(feature = "cuda")]
    {
        if let Ok(d) = Device::new_cuda(0) {
            tracing::info!("using CUDA device 0");
            return Ok(d);
        }
        tracing::warn!("cuda feature on but no CUDA device found; using the CPU");
    }
    Ok(Device::Cpu)
}
