//! Writes the CUDA kernels' PTX for one architecture: `dump_ptx compute_90 out.ptx`
//! (`scripts/ptxas-report.sh` feeds it to ptxas for the register and spill report).

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(arch), Some(out)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: dump_ptx compute_80|compute_90 OUT.ptx");
        std::process::exit(2);
    };
    let arch: &'static str = match arch.as_str() {
        "compute_80" => "compute_80",
        "compute_90" => "compute_90",
        other => {
            eprintln!("unsupported architecture {other}");
            std::process::exit(2);
        }
    };
    match lockstep_engine::cuda::compile(arch) {
        Ok(ptx) => {
            if let Err(e) = std::fs::write(out, ptx.to_src()) {
                eprintln!("{out}: {e}");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
