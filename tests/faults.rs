//! Fault campaign: random device faults (EIO on reads, writes and flushes, ENOSPC, short
//! transfers, latency spikes, a device that vanishes) during random puts, gets and deletes.
//! Every op either succeeds with the right bytes or fails with an error; nothing hangs; after the
//! faults stop, the store reopens with every object in an allowed state and fsck is clean.
//! Contract checked: a failed put or delete leaves the object as it was or as asked, never a mix.
//! `TERAIO_FAULT_ROUNDS` sets the rounds (default 60).

use rand::{RngExt, SeedableRng};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use teraio_e2e::*;
use teraio_engine::{BackendKind, Fault, FaultInjector, FaultRule, IoKind, OpenConfig, Priority, Store};

fn data(seed: u64) -> Vec<u8> {
    random_bytes((seed % 300_000) as usize, seed)
}

#[test]
fn random_faults_never_give_wrong_bytes_or_hang() {
    let rounds: usize = std::env::var("TERAIO_FAULT_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let devices = TempDevices::new(3, 64 << 20);
    let injector = FaultInjector::new();
    let config = || OpenConfig { fault_injector: Some(injector.clone()), ..open_config(BackendKind::Auto) };
    let mut store = Store::create(&devices.paths, &small_format(), config()).unwrap();
    // Allowed states per id: each Some(seed) or None (absent).
    let mut allowed: HashMap<u64, Vec<Option<u64>>> = HashMap::new();
    let (mut ops, mut failed_ops, mut verified_bytes) = (0u64, 0u64, 0u64);
    for round in 0..rounds {
        let device = rng.random_range(0..3u16);
        let kind = [IoKind::Read, IoKind::Write, IoKind::Flush][rng.random_range(0..3)];
        let fault = match rng.random_range(0..6) {
            0 | 1 => Fault::Errno(libc::EIO),
            2 => Fault::Errno(libc::ENOSPC),
            3 => Fault::ShortTransfer,
            4 => Fault::Delay(Duration::from_millis(rng.random_range(1..30))),
            _ => Fault::Errno(libc::ENODEV),
        };
        let mut rule = FaultRule::new(fault).on_device(device).on(kind).after(rng.random_range(0..4));
        if rng.random_bool(0.7) {
            rule = rule.times(rng.random_range(1..5));
        }
        injector.add(rule);
        for _ in 0..8 {
            let id = rng.random_range(0..10u64);
            ops += 1;
            let started = Instant::now();
            match rng.random_range(0..4) {
                0 | 1 => {
                    let seed: u64 = rng.random();
                    match store.put(id, data(seed), &seed.to_le_bytes(), Priority::Normal).and_then(|t| t.wait()) {
                        Ok(_) => {
                            allowed.insert(id, vec![Some(seed)]);
                        }
                        Err(_) => {
                            failed_ops += 1;
                            allowed.entry(id).or_insert_with(|| vec![None]).push(Some(seed));
                        }
                    }
                }
                2 => match store.stat(id) {
                    None => {}
                    Some(info) => {
                        let seed = u64::from_le_bytes(info.meta.try_into().unwrap());
                        match store.get(id, vec![0u8; info.len_bytes as usize], Priority::Urgent).and_then(|t| t.wait())
                        {
                            Ok(bytes) => {
                                assert_eq!(bytes, data(seed), "wrong bytes from object {id} in round {round}");
                                verified_bytes += bytes.len() as u64;
                            }
                            Err(_) => failed_ops += 1,
                        }
                    }
                },
                _ => match store.delete(id) {
                    Ok(_) => {
                        allowed.insert(id, vec![None]);
                    }
                    Err(_) => {
                        failed_ops += 1;
                        allowed.entry(id).or_insert_with(|| vec![None]).push(None);
                    }
                },
            }
            assert!(started.elapsed() < Duration::from_secs(20), "an op hung under faults in round {round}");
        }
        injector.clear();
        if round % 10 == 9 {
            store.close().unwrap();
            store = Store::open(&devices.paths, config()).unwrap();
        }
        // Collapse each id to what the store now shows (it must be one of the allowed states).
        for (id, states) in allowed.iter_mut() {
            let found = store.stat(*id).map(|i| u64::from_le_bytes(i.meta.try_into().unwrap()));
            assert!(states.contains(&found), "object {id}: {found:?} not in {states:?} after round {round}");
            if let Some(seed) = found {
                assert_eq!(store.get_to_vec(*id).unwrap(), data(seed), "object {id} after round {round}");
            }
            *states = vec![found];
        }
    }
    let injected = injector.injected();
    assert!(injected >= rounds as u64 / 3, "only {injected} faults fired");
    assert!(failed_ops > 0, "no op failed: the faults did not reach the data path");
    store.close().unwrap();
    let store = Store::open(&devices.paths, open_config(BackendKind::Auto)).unwrap();
    let report = store.fsck().unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    println!(
        "fault campaign: {rounds} rounds, {injected} faults injected, {ops} ops ({failed_ops} failed cleanly), \
         {verified_bytes} bytes verified, wrong bytes: 0, hangs: 0"
    );
}
