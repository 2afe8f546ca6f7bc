//! The crash-safe object table on disk: two checkpoint slots and a journal ring on the metadata
//! device. A put or delete is acknowledged only once its journal batch is durable; when the ring
//! fills, the whole table is written to the older checkpoint slot with the next generation and the
//! ring starts over. Recovery takes the newest valid checkpoint and replays the journal batches of
//! that generation in sequence. A batch that does not check out ends the log only when nothing
//! valid of that generation follows it (a torn write); otherwise it is damage (see
//! `store::commit::recover`). Every header records the store epoch it was written in, and its crc
//! covers the store uuid too: a header left over from a store formatted earlier on the same
//! device never counts as one of this store's.

use super::codec::{round_up, Decoder, Encoder};
use super::table::{ObjectRecord, TableChange};
use crate::error::{Error, Result};

pub const CHECKPOINT_MAGIC: [u8; 8] = *b"TIOCKPT1";
pub const JOURNAL_MAGIC: [u8; 8] = *b"TIOJRNL1";
/// Bytes reserved for a checkpoint or batch header; the payload starts right after.
pub const HEADER_BYTES: usize = 64;

/// A decoded checkpoint header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointHeader {
    pub generation: u64,
    pub record_count: u64,
    pub payload_bytes: u64,
    pub payload_crc: u32,
    /// Store epoch the checkpoint was written in.
    pub epoch: u64,
}

/// Encodes a checkpoint of `records` as generation `generation`, padded to `block_size`.
pub fn encode_checkpoint<'a>(
    store: &[u8; 16],
    generation: u64,
    epoch: u64,
    records: impl Iterator<Item = &'a ObjectRecord>,
    block_size: u64,
) -> Vec<u8> {
    let mut payload = Encoder::default();
    let mut count = 0u64;
    for r in records {
        r.encode(&mut payload);
        count += 1;
    }
    let mut header = Encoder::with_capacity(HEADER_BYTES);
    header.raw(&CHECKPOINT_MAGIC);
    header.u64(generation);
    header.u64(count);
    header.u64(payload.bytes.len() as u64);
    frame(header, &payload.bytes, store, epoch, block_size)
}

/// The header crc: over the store uuid, then the header's fields.
fn header_crc(store: &[u8; 16], fields: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(store), fields)
}

/// Finishes a header whose fields are written (adds the payload crc, the epoch and the header
/// crc), pads it to `HEADER_BYTES`, appends the payload and pads the whole to `block_size`.
fn frame(mut header: Encoder, payload: &[u8], store: &[u8; 16], epoch: u64, block_size: u64) -> Vec<u8> {
    header.u32(crc32c::crc32c(payload));
    header.u64(epoch);
    let header_crc = header_crc(store, &header.bytes);
    header.u32(header_crc);
    debug_assert!(header.bytes.len() <= HEADER_BYTES);
    let mut bytes = header.bytes;
    bytes.resize(HEADER_BYTES, 0);
    bytes.extend_from_slice(payload);
    let padded = round_up(bytes.len() as u64, block_size) as usize;
    bytes.resize(padded, 0);
    bytes
}

/// Decodes a checkpoint header; `None` where the slot holds no valid header (never written, torn).
pub fn decode_checkpoint_header(block: &[u8], store: &[u8; 16]) -> Option<CheckpointHeader> {
    if block.len() < HEADER_BYTES || block[..8] != CHECKPOINT_MAGIC {
        return None;
    }
    let mut d = Decoder::new(&block[8..], "checkpoint header");
    let h = CheckpointHeader {
        generation: d.u64().ok()?,
        record_count: d.u64().ok()?,
        payload_bytes: d.u64().ok()?,
        payload_crc: d.u32().ok()?,
        epoch: d.u64().ok()?,
    };
    let stored_crc = d.u32().ok()?;
    (header_crc(store, &block[..8 + 8 * 3 + 4 + 8]) == stored_crc).then_some(h)
}

/// Decodes a checkpoint's records from the bytes after its header.
pub fn decode_checkpoint_payload(
    header: &CheckpointHeader,
    payload: &[u8],
    device_count: u16,
) -> Result<Vec<ObjectRecord>> {
    if payload.len() as u64 != header.payload_bytes || crc32c::crc32c(payload) != header.payload_crc {
        return Err(Error::CorruptMetadata {
            detail: format!("checkpoint generation {} payload checksum mismatch", header.generation),
        });
    }
    let mut d = Decoder::new(payload, "checkpoint");
    let mut records = Vec::with_capacity(header.record_count.min(1 << 20) as usize);
    for _ in 0..header.record_count {
        records.push(ObjectRecord::decode(&mut d, device_count)?);
    }
    if d.remaining() != 0 {
        return Err(Error::CorruptMetadata { detail: "checkpoint has trailing bytes".into() });
    }
    Ok(records)
}

/// A decoded journal batch header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    pub generation: u64,
    pub sequence: u64,
    pub change_count: u32,
    pub payload_bytes: u32,
    pub payload_crc: u32,
    /// Store epoch the batch was written in.
    pub epoch: u64,
}

impl BatchHeader {
    /// Bytes the whole batch occupies in the ring.
    pub fn padded_bytes(&self, block_size: u64) -> u64 {
        round_up(HEADER_BYTES as u64 + self.payload_bytes as u64, block_size)
    }
}

/// Encodes one journal batch, padded to `block_size`.
pub fn encode_batch(
    store: &[u8; 16],
    generation: u64,
    sequence: u64,
    epoch: u64,
    changes: &[TableChange],
    block_size: u64,
) -> Vec<u8> {
    let mut payload = Encoder::default();
    for c in changes {
        c.encode(&mut payload);
    }
    let mut header = Encoder::with_capacity(HEADER_BYTES);
    header.raw(&JOURNAL_MAGIC);
    header.u64(generation);
    header.u64(sequence);
    header.u32(changes.len() as u32);
    header.u32(payload.bytes.len() as u32);
    frame(header, &payload.bytes, store, epoch, block_size)
}

/// Decodes a batch header; `None` where the bytes are not a valid header.
pub fn decode_batch_header(block: &[u8], store: &[u8; 16]) -> Option<BatchHeader> {
    if block.len() < HEADER_BYTES || block[..8] != JOURNAL_MAGIC {
        return None;
    }
    let mut d = Decoder::new(&block[8..], "journal header");
    let h = BatchHeader {
        generation: d.u64().ok()?,
        sequence: d.u64().ok()?,
        change_count: d.u32().ok()?,
        payload_bytes: d.u32().ok()?,
        payload_crc: d.u32().ok()?,
        epoch: d.u64().ok()?,
    };
    let stored_crc = d.u32().ok()?;
    (header_crc(store, &block[..8 + 8 * 2 + 4 * 3 + 8]) == stored_crc).then_some(h)
}

/// Whether `block` holds the header of batch `sequence` of `generation` whose checksum fails:
/// at least two of its magic, generation and sequence fields are those expected. One flipped bit
/// breaks at most one of them, while the rest of a ring (zeros, older batches' payloads, an
/// older generation's header) matches at most one by chance.
pub fn is_damaged_batch_header(block: &[u8], generation: u64, sequence: u64) -> bool {
    if block.len() < HEADER_BYTES {
        return false;
    }
    let field = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().expect("8 bytes"));
    let matches = [block[..8] == JOURNAL_MAGIC, field(8) == generation, field(16) == sequence];
    matches.iter().filter(|&&m| m).count() >= 2
}

/// Decodes a batch's changes; `None` where the payload is torn (its checksum fails).
pub fn decode_batch_payload(header: &BatchHeader, payload: &[u8], device_count: u16) -> Option<Vec<TableChange>> {
    if payload.len() != header.payload_bytes as usize || crc32c::crc32c(payload) != header.payload_crc {
        return None;
    }
    let mut d = Decoder::new(payload, "journal batch");
    let changes: Result<Vec<_>> = (0..header.change_count).map(|_| TableChange::decode(&mut d, device_count)).collect();
    changes.ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::alloc::Extent;

    const STORE: [u8; 16] = [7; 16];

    fn record(id: u64) -> ObjectRecord {
        ObjectRecord {
            id,
            len_bytes: id * 10,
            meta: vec![id as u8; 3],
            first_device: 0,
            spread: 1,
            extents: vec![Extent { device: 0, start_block: id, len_blocks: 1 }],
            unit_crcs: vec![],
        }
    }

    #[test]
    fn checkpoint_round_trip_and_torn_payload() {
        let records: Vec<_> = (1..50).map(record).collect();
        let bytes = encode_checkpoint(&STORE, 7, 3, records.iter(), 4096);
        assert_eq!(bytes.len() % 4096, 0);
        assert!(decode_checkpoint_header(&bytes, &[8; 16]).is_none(), "another store's checkpoint");
        let h = decode_checkpoint_header(&bytes, &STORE).unwrap();
        assert_eq!((h.generation, h.epoch), (7, 3));
        let payload = &bytes[HEADER_BYTES..HEADER_BYTES + h.payload_bytes as usize];
        assert_eq!(decode_checkpoint_payload(&h, payload, 1).unwrap(), records);
        let mut torn = payload.to_vec();
        torn[5] ^= 0x40;
        assert!(decode_checkpoint_payload(&h, &torn, 1).is_err());
        let mut bad_header = bytes.clone();
        bad_header[9] ^= 1;
        assert!(decode_checkpoint_header(&bad_header, &STORE).is_none());
    }

    #[test]
    fn batch_round_trip_and_torn_payload() {
        let changes = vec![TableChange::Put(record(3)), TableChange::Delete { id: 2 }];
        let bytes = encode_batch(&STORE, 4, 11, 5, &changes, 4096);
        assert!(decode_batch_header(&bytes, &[8; 16]).is_none(), "another store's batch");
        let h = decode_batch_header(&bytes, &STORE).unwrap();
        assert_eq!((h.generation, h.sequence, h.change_count, h.epoch), (4, 11, 2, 5));
        let mut bad_epoch = bytes.clone();
        bad_epoch[40] ^= 1;
        assert!(decode_batch_header(&bad_epoch, &STORE).is_none(), "the epoch is covered by the header crc");
        assert_eq!(h.padded_bytes(4096), 4096);
        let payload = &bytes[HEADER_BYTES..HEADER_BYTES + h.payload_bytes as usize];
        assert_eq!(decode_batch_payload(&h, payload, 1).unwrap(), changes);
        let mut torn = payload.to_vec();
        torn[0] ^= 1;
        assert!(decode_batch_payload(&h, &torn, 1).is_none());
    }

    #[test]
    fn a_damaged_batch_header_is_known_by_its_identity() {
        let bytes = encode_batch(&STORE, 5, 9, 2, &[TableChange::Delete { id: 1 }], 4096);
        assert!(decode_batch_header(&bytes, &STORE).is_some());
        // One flipped bit anywhere in the crc-covered header leaves two of magic, generation and
        // sequence: the header is known as batch 9 of generation 5, damaged.
        for byte in 0..48 {
            for bit in 0..8 {
                let mut flipped = bytes.clone();
                flipped[byte] ^= 1 << bit;
                if decode_batch_header(&flipped, &STORE).is_none() {
                    assert!(is_damaged_batch_header(&flipped, 5, 9), "byte {byte} bit {bit}");
                }
            }
        }
        // Another batch's header, zeros and payload bytes are not.
        assert!(!is_damaged_batch_header(&bytes, 6, 10));
        assert!(!is_damaged_batch_header(&[0u8; 4096], 5, 9));
        assert!(!is_damaged_batch_header(&bytes[64..], 5, 9));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_headers_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = decode_batch_header(&bytes, &STORE);
            let _ = decode_checkpoint_header(&bytes, &STORE);
        }
    }
}
