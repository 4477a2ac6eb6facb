//! Meta, the epoch and the operations log.

use super::*;

#[test]
fn meta_epoch_rotation_and_reserved_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    let before = store.epoch().expect("epoch");
    assert!(uuid::Uuid::parse_str(&before).is_ok());
    let rot = store.rotate_epoch().expect("rotate");
    assert_eq!(rot.from, before);
    assert_ne!(rot.to, before);
    assert_eq!(store.epoch().expect("epoch"), rot.to, "read on each use");
    for k in ["epoch", "relay_pubkey", "schema_version", "heartbeat"] {
        assert!(matches!(
            store.set_meta(k, "x"),
            Err(StoreError::InvalidInput(_))
        ));
    }
    assert_eq!(store.meta("nothing").expect("meta"), None);
}

#[test]
fn the_ops_log_keeps_the_last_thousand_newest_first() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(open(dir.path()));
    // Append from a few threads so the writer groups them (fewer fsyncs).
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                for i in 0..252 {
                    store
                        .append_op(i, "relay-backup", &serde_json::json!({"t": t, "i": i}))
                        .expect("append");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("join");
    }
    let all = store.ops(5_000).expect("ops");
    assert_eq!(all.len(), 1_000);
    assert!(all.windows(2).all(|w| w[0].id > w[1].id), "newest first");
    assert_eq!(all[0].id, 1_008);
    assert_eq!(store.ops(0).expect("ops").len(), 1);
}
