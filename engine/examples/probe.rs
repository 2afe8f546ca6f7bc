//! A quick throughput probe of the engine on one or more files: sequential put and get of one
//! object, then random 4 KiB reads. `cargo run --release --example probe -- DIR SIZE_GIB DEVICES`.
use std::time::Instant;
use teraio_engine::*;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&args[1]);
    let gib: u64 = args[2].parse().unwrap();
    let n: usize = args[3].parse().unwrap();
    let size = gib * GIB;
    let paths: Vec<_> = (0..n).map(|i| dir.join(format!("probe{i}"))).collect();
    let per_dev = size / n as u64 + 512 * MIB;
    let fmt = FormatConfig {
        stripe_unit_bytes: 4 * MIB,
        create_file_bytes: Some(per_dev),
        force: true,
        ..Default::default()
    };
    let open = OpenConfig {
        queue_depth: 32,
        max_io_bytes: 4 * MIB,
        max_inflight_bytes: 32 * 4 * MIB * n as u64 + 8 * MIB,
        ..Default::default()
    };
    let store = Store::create(&paths, &fmt, open.clone())?;
    let mut buf = AlignedBuf::new(size as usize, 4096)?;
    for (i, b) in buf.iter_mut().enumerate().step_by(4096) {
        *b = i as u8;
    }
    let t = Instant::now();
    let buf = store.put(1, buf, b"", Priority::Normal)?.wait()?;
    let put_s = t.elapsed().as_secs_f64();
    store.reset_stats();
    let t = Instant::now();
    let buf = store.get(1, buf, Priority::Normal)?.wait()?;
    let get_s = t.elapsed().as_secs_f64();
    drop(buf);
    println!("put {:.2} GiB/s, get {:.2} GiB/s", gib as f64 / put_s, gib as f64 / get_s);
    drop(store);
    let open = OpenConfig { queue_depth: 128 / n, ..open };
    let store = Store::open(&paths, open)?;
    let blocks = size / 4096;
    let mut tickets = std::collections::VecDeque::new();
    let mut x: u64 = 88172645463325252;
    let t = Instant::now();
    let mut done = 0u64;
    while t.elapsed().as_secs_f64() < 5.0 {
        while tickets.len() < 128 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let off = (x % blocks) * 4096;
            tickets.push_back(store.get_range(1, off, AlignedBuf::new(4096, 4096)?, Priority::Normal)?);
        }
        tickets.pop_front().unwrap().wait()?;
        done += 1;
    }
    println!("rand 4k: {:.0} IOPS", done as f64 / t.elapsed().as_secs_f64());
    Ok(())
}
