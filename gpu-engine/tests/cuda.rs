//! CUDA backend checks that need no GPU: the kernels compile with NVRTC for sm_80 and sm_90
//! (CI installs NVRTC 13.0 from PyPI and requires it with LOCKSTEP_REQUIRE_NVRTC=1), device
//! selection parses and falls back to CPU where the driver is absent, without panicking.

use lockstep_engine::cuda::{self, CudaError, DeviceChoice, KERNEL_NAMES};

fn nvrtc_or_skip() -> bool {
    if cuda::nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var("LOCKSTEP_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "LOCKSTEP_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
    );
    eprintln!("skipped: NVRTC not found");
    false
}

#[test]
fn every_kernel_compiles_to_ptx_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let ptx = cuda::compile(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let src = ptx.to_src();
        let target = arch.replace("compute_", "sm_");
        assert!(
            src.contains(&format!(".target {target}")),
            "{arch}: no .target line"
        );
        for name in KERNEL_NAMES {
            assert!(
                src.contains(&format!(".entry {name}(")),
                "{arch}: kernel {name} missing from the PTX"
            );
        }
        // The PTX must load on the CUDA 13.0 driver of the GPU machine: ISA 9.0 at most.
        let version = src
            .lines()
            .find_map(|l| l.strip_prefix(".version "))
            .expect("PTX .version line");
        let (major, minor) = version.trim().split_once('.').expect("major.minor");
        let v: (u32, u32) = (major.parse().unwrap(), minor.parse().unwrap());
        assert!(
            v <= (9, 0),
            "{arch}: PTX ISA {version} is newer than CUDA 13.0 loads"
        );
    }
}

#[test]
fn a_kernel_source_error_is_a_compile_error_not_a_panic() {
    if !nvrtc_or_skip() {
        return;
    }
    let err = cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void k() { undefined_thing; }");
    assert!(err.is_err());
}

#[test]
fn device_choice_parses_and_prints() {
    for (s, want) in [
        ("auto", DeviceChoice::Auto),
        ("cpu", DeviceChoice::Cpu),
        ("cuda:0", DeviceChoice::Cuda(0)),
        ("cuda:3", DeviceChoice::Cuda(3)),
    ] {
        assert_eq!(s.parse::<DeviceChoice>(), Ok(want));
        assert_eq!(want.to_string(), s);
    }
    for bad in ["gpu", "cuda", "cuda:", "cuda:x", "CUDA:0", ""] {
        let e = bad.parse::<DeviceChoice>().unwrap_err();
        assert!(e.contains("auto, cpu or cuda:N"), "{bad}: {e}");
    }
}

#[test]
fn without_a_driver_auto_is_cpu_and_cuda_n_is_a_clear_error() {
    if cuda::libraries().driver {
        eprintln!("skipped: a CUDA driver is present (the GPU check script covers this machine)");
        return;
    }
    assert!(matches!(cuda::select(DeviceChoice::Auto), Ok(None)));
    assert!(matches!(cuda::select(DeviceChoice::Cpu), Ok(None)));
    match cuda::select(DeviceChoice::Cuda(0)) {
        Err(CudaError::Unavailable(why)) => assert!(why.contains("libcuda"), "{why}"),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[test]
fn architectures_below_sm80_are_refused() {
    assert_eq!(cuda::arch_for(9, 0), Ok("compute_90"));
    assert_eq!(cuda::arch_for(10, 0), Ok("compute_90"));
    assert_eq!(cuda::arch_for(8, 0), Ok("compute_80"));
    assert_eq!(cuda::arch_for(8, 9), Ok("compute_89"));
    assert!(matches!(
        cuda::arch_for(7, 5),
        Err(CudaError::Unavailable(_))
    ));
}
