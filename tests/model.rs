//! Property test: random sequences of put/get/ranged get/delete/reopen on a real striped store
//! match an in-memory model byte for byte, on both backends.

use proptest::prelude::*;
use std::collections::HashMap;
use teraio_e2e::*;
use teraio_engine::{BackendKind, Priority, Store};

#[derive(Debug, Clone)]
enum Step {
    Put { id: u64, len: usize, seed: u64, urgent: bool },
    Get { id: u64 },
    GetRange { id: u64, at: f64, len: usize },
    Delete { id: u64 },
    Reopen,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u64..12, prop_oneof![0usize..5000, 0usize..400_000], any::<u64>(), any::<bool>())
            .prop_map(|(id, len, seed, urgent)| Step::Put { id, len, seed, urgent }),
        3 => (0u64..12).prop_map(|id| Step::Get { id }),
        2 => (0u64..12, 0.0f64..1.0, 1usize..70_000).prop_map(|(id, at, len)| Step::GetRange { id, at, len }),
        2 => (0u64..12).prop_map(|id| Step::Delete { id }),
        1 => Just(Step::Reopen),
    ]
}

fn run(backend: BackendKind, steps: &[Step]) -> Result<(), TestCaseError> {
    let devices = TempDevices::new(3, 48 << 20);
    let mut store = Some(create(&devices, backend));
    let mut model: HashMap<u64, (Vec<u8>, Vec<u8>)> = HashMap::new();
    for s in steps {
        let st = store.as_ref().unwrap();
        match s {
            Step::Put { id, len, seed, urgent } => {
                let data = random_bytes(*len, *seed);
                let meta = seed.to_le_bytes().to_vec();
                let p = if *urgent { Priority::Urgent } else { Priority::Normal };
                st.put(*id, data.clone(), &meta, p).unwrap().wait().unwrap();
                model.insert(*id, (data, meta));
            }
            Step::Get { id } => match model.get(id) {
                Some((data, meta)) => {
                    prop_assert_eq!(&st.get_to_vec(*id).unwrap(), data);
                    prop_assert_eq!(&st.stat(*id).unwrap().meta, meta);
                }
                None => prop_assert!(st.stat(*id).is_none()),
            },
            Step::GetRange { id, at, len } => {
                if let Some((data, _)) = model.get(id) {
                    if !data.is_empty() {
                        let offset = ((data.len() - 1) as f64 * at) as usize;
                        let len = (*len).min(data.len() - offset);
                        let out =
                            st.get_range(*id, offset as u64, vec![0u8; len], Priority::Normal).unwrap().wait().unwrap();
                        prop_assert_eq!(&out[..], &data[offset..offset + len]);
                    }
                }
            }
            Step::Delete { id } => {
                let existed = st.delete(*id).unwrap();
                prop_assert_eq!(existed, model.remove(id).is_some());
            }
            Step::Reopen => {
                store.take().unwrap().close().unwrap();
                store = Some(Store::open(&devices.paths, open_config(backend)).unwrap());
            }
        }
    }
    let st = store.take().unwrap();
    prop_assert_eq!(st.list().len(), model.len());
    prop_assert!(st.fsck().unwrap().is_clean());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(std::env::var("TERAIO_MODEL_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(32)))]

    #[test]
    fn io_uring_matches_the_model(steps in proptest::collection::vec(step(), 1..40)) {
        run(BackendKind::IoUring, &steps)?;
    }

    #[test]
    fn psync_matches_the_model(steps in proptest::collection::vec(step(), 1..40)) {
        run(BackendKind::Psync, &steps)?;
    }
}
