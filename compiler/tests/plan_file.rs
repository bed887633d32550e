//! The plan file's reader refuses what a hand edit can break, each refusal naming what and where.

use sched_ir::plan_file::{emit_plan, read_plan};
use schedc::{analyze, compile, MemLoader};
use std::path::Path;

/// A compiled plan file of a small job, as JSON.
fn plan_json() -> serde_json::Value {
    let text = "cluster c { nodes = 1  gpus_per_node = 2  gpu_memory = 4 GiB  peak_flops = 1 TFLOPS
            intra_node { bandwidth = 10 GB/s  latency = 1 us }  inter_node { bandwidth = 1 Gbps  latency = 50 us } }
        model m { dtype = fp32  seq_len = 8
            layer embed = embedding(vocab = 256, hidden = 16)
            layer head = lm_head(hidden = 16, vocab = 256, tied = true) }
        schedule s { model = m  cluster = c  preset = zero3 }";
    let loader = MemLoader::default().in_dir("/p").with("/p/s.sched", text);
    let a = analyze(Path::new("/p/s.sched"), &loader).unwrap();
    let job = &a.jobs[0];
    let p = compile(job).unwrap();
    serde_json::to_value(emit_plan(&p, job)).unwrap()
}

/// A stream's workspace must name an existing `workspace` buffer that can hold its GEMM part.
#[test]
fn stream_workspaces_are_read_strictly() {
    let plan = plan_json();
    assert!(read_plan(&plan.to_string()).is_ok());
    let ws = plan["streams"][0]["workspace"].clone();
    let buffer = ws["buffer"].as_u64().unwrap() as usize;
    let bytes = plan["buffers"][buffer]["bytes"].as_u64().unwrap();
    let refused = |edit: &dyn Fn(&mut serde_json::Value), says: &str| {
        let mut p = plan.clone();
        edit(&mut p);
        let e = read_plan(&p.to_string())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains(says), "{says}: {e}");
    };
    refused(
        &|p| p["streams"][0]["workspace"]["buffer"] = 99_999.into(),
        "workspace buffer 99999 does not exist",
    );
    refused(
        &|p| p["streams"][0]["workspace"]["buffer"] = 0.into(),
        "is a `param_shard` buffer, not a `workspace` one",
    );
    refused(
        &|p| p["streams"][0]["workspace"]["gemm_bytes"] = (bytes + 1).into(),
        "does not fit its",
    );
    refused(
        &|p| p["streams"][0]["workspace"]["extra"] = 1.into(),
        "unknown field `extra`",
    );
    refused(
        &|p| p["buffers"][buffer]["kind"] = "scratch".into(),
        "unknown kind `scratch`",
    );
}

/// A plan's job without tensor parallelism leaves `tensor` out; one that asks for it (t > 1)
/// does not match any program (tensor parallelism is not lowered yet) and is refused.
#[test]
fn a_job_with_tensor_parallelism_is_refused() {
    let plan = plan_json();
    assert!(plan["job"]["schedule"].get("tensor").is_none());
    let mut p = plan.clone();
    p["job"]["schedule"]["tensor"] = serde_json::json!({ "size": 2, "sequence": false });
    let e = read_plan(&p.to_string())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("the plan's `job` does not match its program: it has tensor groups of 2 ranks"),
        "{e}"
    );
    // Written out as the default, it reads as before.
    let mut p = plan.clone();
    p["job"]["schedule"]["tensor"] = serde_json::json!({ "size": 1, "sequence": false });
    assert!(read_plan(&p.to_string()).is_ok());
}

/// The model's `norm_eps` and `rope_base` are absent from plans that do not set them (which read
/// with the defaults, as plans written before the keys did); set, they read back, and out of the
/// language's range they are refused.
#[test]
fn norm_eps_and_rope_base_are_optional_and_checked() {
    let plan = plan_json();
    assert!(plan["job"]["model"].get("norm_eps").is_none());
    assert!(plan["job"]["model"].get("rope_base").is_none());
    let read = |p: &serde_json::Value| read_plan(&p.to_string()).map(|r| r.job.model);
    let model = read(&plan).unwrap();
    assert_eq!((model.norm_eps(), model.rope_base()), (1e-5, 10_000.0));
    let mut p = plan.clone();
    p["job"]["model"]["norm_eps"] = 1e-6.into();
    p["job"]["model"]["rope_base"] = 500_000.0.into();
    let model = read(&p).unwrap();
    assert_eq!((model.norm_eps(), model.rope_base()), (1e-6, 500_000.0));
    for (key, value, says) in [
        ("norm_eps", 0.0, "norm_eps 0 is not in (0, 1]"),
        ("norm_eps", 1e-50, "is not in (0, 1]"),
        ("rope_base", 0.5, "rope_base 0.5 is not above 1"),
    ] {
        let mut p = plan.clone();
        p["job"]["model"][key] = value.into();
        let e = read(&p).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(says), "{key} {value}: {e}");
    }
}
