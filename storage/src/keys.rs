//! Byte layout of keys and values in the RocksDB column families, plus the argument
//! limits shared by both stores. See the crate documentation for the overall picture.

use crate::{Offset, QueueId, StorageError};

/// Length of an `entries` key: queue id (u64 BE) ++ offset (u64 BE).
pub const ENTRY_KEY_BYTES: usize = 16;
/// Length of a `meta` key: queue id (u64 BE) ++ one field byte.
pub const META_KEY_BYTES: usize = 9;
/// Length of a big-endian u64 value or key part.
pub const U64_BYTES: usize = 8;
/// Longest region name, in bytes (the name length is stored as a u16).
pub const MAX_REGION_NAME_BYTES: usize = u16::MAX as usize;
/// Longest region key or node-state key, in bytes.
pub const MAX_KEY_BYTES: usize = 1 << 20;
/// Largest stored value (entry body + flag byte, info + epoch, region or state value), in bytes.
pub const MAX_VALUE_BYTES: usize = 1 << 30;

/// `meta` field byte: value = acked offset, u64 BE.
pub const META_FIELD_ACKED: u8 = 1;
/// `meta` field byte: value = delivered offset, u64 BE.
pub const META_FIELD_DELIVERED: u8 = 2;
/// `meta` field byte: value = epoch (u64 BE) ++ info blob.
pub const META_FIELD_INFO: u8 = 3;

pub(crate) fn check_region(region: &str) -> Result<(), StorageError> {
    if region.len() > MAX_REGION_NAME_BYTES {
        return Err(StorageError::InvalidArgument(format!(
            "region name of {} bytes exceeds {MAX_REGION_NAME_BYTES}",
            region.len()
        )));
    }
    Ok(())
}

pub(crate) fn check_key(key: &str) -> Result<(), StorageError> {
    if key.len() > MAX_KEY_BYTES {
        return Err(StorageError::InvalidArgument(format!(
            "key of {} bytes exceeds {MAX_KEY_BYTES}",
            key.len()
        )));
    }
    Ok(())
}

pub(crate) fn check_value(len: usize) -> Result<(), StorageError> {
    if len > MAX_VALUE_BYTES {
        return Err(StorageError::InvalidArgument(format!(
            "value of {len} bytes exceeds {MAX_VALUE_BYTES}"
        )));
    }
    Ok(())
}

/// `entries` key of `(queue, offset)`.
pub fn entry_key(queue: QueueId, offset: Offset) -> [u8; ENTRY_KEY_BYTES] {
    let mut k = [0u8; ENTRY_KEY_BYTES];
    k[..U64_BYTES].copy_from_slice(&queue.to_be_bytes());
    k[U64_BYTES..].copy_from_slice(&offset.to_be_bytes());
    k
}

/// The smallest key strictly greater than `entry_key(queue, offset)` (that key ++ `0x00`):
/// an exclusive upper bound that includes `(queue, offset)`, valid even for `u64::MAX`.
pub fn entry_key_after(queue: QueueId, offset: Offset) -> [u8; ENTRY_KEY_BYTES + 1] {
    let mut k = [0u8; ENTRY_KEY_BYTES + 1];
    k[..ENTRY_KEY_BYTES].copy_from_slice(&entry_key(queue, offset));
    k
}

/// Decodes an `entries` key.
pub fn decode_entry_key(key: &[u8]) -> Result<(QueueId, Offset), StorageError> {
    if key.len() != ENTRY_KEY_BYTES {
        return Err(StorageError::Corrupt(format!(
            "entry key of {} bytes",
            key.len()
        )));
    }
    Ok((read_u64(&key[..U64_BYTES]), read_u64(&key[U64_BYTES..])))
}

/// Splits an `entries` value into flags and body.
pub fn decode_entry_value(value: &[u8]) -> Result<(u8, &[u8]), StorageError> {
    match value.split_first() {
        Some((flags, body)) => Ok((*flags, body)),
        None => Err(StorageError::Corrupt("empty entry value".into())),
    }
}

/// Encodes an `entries` value, `[flags][body...]`, into `v` (cleared first, its allocation
/// reused).
pub fn encode_entry_value(v: &mut Vec<u8>, flags: u8, body: &[u8]) {
    v.clear();
    v.reserve(body.len() + 1);
    v.push(flags);
    v.extend_from_slice(body);
}

/// `meta` key of one field of a queue.
pub fn meta_key(queue: QueueId, field: u8) -> [u8; META_KEY_BYTES] {
    let mut k = [0u8; META_KEY_BYTES];
    k[..U64_BYTES].copy_from_slice(&queue.to_be_bytes());
    k[U64_BYTES] = field;
    k
}

/// `[lower, upper)` bounds covering every `meta` key of `queue`.
pub fn meta_bounds(queue: QueueId) -> ([u8; U64_BYTES], [u8; U64_BYTES + 2]) {
    let lower = queue.to_be_bytes();
    let mut upper = [0xFFu8; U64_BYTES + 2];
    upper[..U64_BYTES].copy_from_slice(&lower);
    (lower, upper)
}

/// Decodes a `meta` key into queue id and field byte.
pub fn decode_meta_key(key: &[u8]) -> Result<(QueueId, u8), StorageError> {
    if key.len() != META_KEY_BYTES {
        return Err(StorageError::Corrupt(format!(
            "meta key of {} bytes",
            key.len()
        )));
    }
    Ok((read_u64(&key[..U64_BYTES]), key[U64_BYTES]))
}

/// Decodes a u64 BE value.
pub fn decode_u64_value(value: &[u8], what: &str) -> Result<u64, StorageError> {
    if value.len() != U64_BYTES {
        return Err(StorageError::Corrupt(format!(
            "{what} value of {} bytes",
            value.len()
        )));
    }
    Ok(read_u64(value))
}

/// Encodes the info field value: epoch (u64 BE) ++ info.
pub fn encode_info_value(epoch: u64, info: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(U64_BYTES + info.len());
    v.extend_from_slice(&epoch.to_be_bytes());
    v.extend_from_slice(info);
    v
}

/// Decodes the info field value into epoch and info.
pub fn decode_info_value(value: &[u8]) -> Result<(u64, &[u8]), StorageError> {
    if value.len() < U64_BYTES {
        return Err(StorageError::Corrupt(format!(
            "info value of {} bytes",
            value.len()
        )));
    }
    Ok((read_u64(&value[..U64_BYTES]), &value[U64_BYTES..]))
}

/// Prefix shared by every key of `region`: name length (u16 BE) ++ name.
pub fn region_prefix(region: &str) -> Result<Vec<u8>, StorageError> {
    check_region(region)?;
    let mut k = Vec::with_capacity(2 + region.len());
    k.extend_from_slice(&(region.len() as u16).to_be_bytes());
    k.extend_from_slice(region.as_bytes());
    Ok(k)
}

/// `regions` key: name length (u16 BE) ++ name ++ key.
pub fn region_key(region: &str, key: &str) -> Result<Vec<u8>, StorageError> {
    check_key(key)?;
    let mut k = region_prefix(region)?;
    k.extend_from_slice(key.as_bytes());
    Ok(k)
}

/// The region and key of a `regions` key ([`region_key`]).
pub fn split_region_key(k: &[u8]) -> Result<(&str, &str), StorageError> {
    let corrupt = || StorageError::Corrupt(format!("region key {k:02x?} is not (region, key)"));
    let len = k
        .get(..2)
        .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
        .ok_or_else(corrupt)?;
    let region = k.get(2..2 + len).ok_or_else(corrupt)?;
    let key = &k[2 + len..];
    Ok((
        std::str::from_utf8(region).map_err(|_| corrupt())?,
        std::str::from_utf8(key).map_err(|_| corrupt())?,
    ))
}

/// The smallest byte string greater than every string starting with `prefix`, or `None`
/// when there is none (prefix empty or all `0xFF`).
pub fn prefix_successor(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut s = prefix.to_vec();
    while let Some(last) = s.last_mut() {
        if *last == 0xFF {
            s.pop();
        } else {
            *last += 1;
            return Some(s);
        }
    }
    None
}

fn read_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; U64_BYTES];
    a.copy_from_slice(b);
    u64::from_be_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_keys_order_and_bounds() {
        assert!(entry_key(1, u64::MAX) < entry_key(2, 0));
        assert!(entry_key(1, 5)[..] < entry_key_after(1, 5)[..]);
        assert!(entry_key_after(1, 5)[..] < entry_key(1, 6)[..]);
        assert!(entry_key_after(1, u64::MAX)[..] < entry_key(2, 0)[..]);
        assert_eq!(decode_entry_key(&entry_key(7, 9)).unwrap(), (7, 9));
        assert!(decode_entry_key(&[1, 2]).is_err());
        assert!(decode_entry_value(&[]).is_err());
    }

    #[test]
    fn meta_bounds_cover_fields_only() {
        let (lo, hi) = meta_bounds(u64::MAX);
        for f in [0u8, 1, 255] {
            let k = meta_key(u64::MAX, f);
            assert!(lo[..] <= k[..] && k[..] < hi[..]);
        }
        let (_, hi) = meta_bounds(4);
        assert!(hi[..] < meta_key(5, 0)[..]);
    }

    #[test]
    fn region_prefixes_do_not_overlap() {
        let a = region_prefix("a").unwrap();
        let ab = region_key("ab", "").unwrap();
        assert!(!ab.starts_with(&a));
        assert_eq!(prefix_successor(&[1, 0xFF]), Some(vec![2]));
        assert_eq!(prefix_successor(&[0xFF]), None);
        assert!(region_prefix(&"x".repeat(MAX_REGION_NAME_BYTES + 1)).is_err());
    }
}
