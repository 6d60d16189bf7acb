//! Cluster: what each device and link can do (docs/formats.md, "Cluster").

use crate::error::{parse_toml, Error, Result};
use crate::inputs::read_file;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    #[serde(default)]
    pub defaults: Defaults,
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
    #[serde(default)]
    pub links: Vec<LinkSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Defaults {
    #[serde(default = "one")]
    pub speed: f64,
    pub memory: Option<u64>,
    pub memory_microbatches: Option<u32>,
    #[serde(default)]
    pub latency: f64,
    #[serde(default = "infinite")]
    pub bandwidth: f64,
    #[serde(default)]
    pub overhead: f64,
}

fn one() -> f64 {
    1.0
}
fn infinite() -> f64 {
    f64::INFINITY
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            speed: 1.0,
            memory: None,
            memory_microbatches: None,
            latency: 0.0,
            bandwidth: f64::INFINITY,
            overhead: 0.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    pub name: String,
    pub region: Option<String>,
    pub speed: Option<f64>,
    pub memory: Option<u64>,
    pub memory_microbatches: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    pub a: String,
    pub b: String,
    pub latency: Option<f64>,
    pub bandwidth: Option<f64>,
    pub overhead: Option<f64>,
}

/// A device with its defaults applied.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Device {
    pub name: String,
    pub region: String,
    pub speed: f64,
    pub memory: Option<u64>,
    pub memory_microbatches: Option<u32>,
}

/// A directed point-to-point path between two devices.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    pub latency: f64,
    pub bandwidth: f64,
    pub overhead: f64,
}

impl Link {
    pub const FREE: Link = Link {
        latency: 0.0,
        bandwidth: f64::INFINITY,
        overhead: 0.0,
    };

    /// `latency + bytes / bandwidth + overhead` (docs/formats.md).
    pub fn transfer_time(&self, bytes: u64) -> f64 {
        self.latency + bytes as f64 / self.bandwidth + self.overhead
    }
}

/// A resolved cluster: devices in file order and a full link matrix.
/// Devices and the links between them, stored sparsely (memory linear in the devices and the
/// links a file names): a default link, links between regions, and links between devices, the
/// most specific winning.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub devices: Vec<Device>,
    /// Every pair's link unless a region pair or a device pair says otherwise.
    default_link: Link,
    /// Each device's region, numbered.
    region_of: Vec<u32>,
    /// Links between two regions, keyed (low, high); they apply both ways.
    region_links: HashMap<(u32, u32), Link>,
    /// Links between two devices, keyed (low, high); they apply both ways.
    device_links: HashMap<(u32, u32), Link>,
    /// Each device's index in the cluster it was loaded as (a subset may hold one twice).
    origin: Vec<u32>,
    /// Regions, and with few of them every region pair's link in a table (the hot path of
    /// the simulator and the skip scheduler, which ask for links millions of times).
    regions: usize,
    region_matrix: Vec<Link>,
}

/// Region tables are kept up to this many regions (a 256 x 256 table of links: 1.5 MB).
const REGION_TABLE_MAX: usize = 256;

/// A pair's key, low index first (links apply both ways).
fn pair(a: usize, b: usize) -> (u32, u32) {
    let (a, b) = (a as u32, b as u32);
    (a.min(b), a.max(b))
}

/// The file's devices, with each name's index; a name given twice, a bad speed or no device
/// at all is an error naming where.
fn resolve_devices<'f>(
    file: &str,
    f: &'f ClusterFile,
) -> Result<(Vec<Device>, HashMap<&'f str, usize>)> {
    let d = &f.defaults;
    if f.devices.is_empty() {
        return Err(Error::input(
            file,
            "no [[devices]]: a cluster needs at least one device",
        ));
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut devices = Vec::new();
    for (i, s) in f.devices.iter().enumerate() {
        if let Some(first) = seen.insert(s.name.as_str(), i) {
            return Err(Error::input(
                file,
                format!(
                    "devices[{i}]: device \"{}\" is named twice (first at devices[{first}])",
                    s.name
                ),
            ));
        }
        let speed = s.speed.unwrap_or(d.speed);
        check_num(
            file,
            &format!("devices[{i}] (\"{}\").speed", s.name),
            speed,
            true,
        )?;
        devices.push(Device {
            name: s.name.clone(),
            region: s.region.clone().unwrap_or_else(|| s.name.clone()),
            speed,
            memory: s.memory.or(d.memory),
            memory_microbatches: s.memory_microbatches.or(d.memory_microbatches),
        });
    }
    Ok((devices, seen))
}

/// Links between two regions and between two devices, keyed (low, high).
type Links = (HashMap<(u32, u32), Link>, HashMap<(u32, u32), Link>);

/// The file's links, between two devices or between two regions, checked: each pair once,
/// numbers in range.
fn resolve_links(
    file: &str,
    f: &ClusterFile,
    seen: &HashMap<&str, usize>,
    region_ids: &HashMap<&str, u32>,
) -> Result<Links> {
    let d = &f.defaults;
    let mut region_links = HashMap::new();
    let mut device_links = HashMap::new();
    let mut set_by: HashMap<(String, String), usize> = HashMap::new();
    for (k, l) in f.links.iter().enumerate() {
        let key = if l.a <= l.b {
            (l.a.clone(), l.b.clone())
        } else {
            (l.b.clone(), l.a.clone())
        };
        if let Some(first) = set_by.insert(key, k) {
            return Err(Error::input(
                file,
                format!(
                    "links[{k}]: link {}-{} is given twice (first at links[{first}])",
                    l.a, l.b
                ),
            ));
        }
        let at = format!("links[{k}] ({}-{})", l.a, l.b);
        let link = Link {
            latency: l.latency.unwrap_or(d.latency),
            bandwidth: l.bandwidth.unwrap_or(d.bandwidth),
            overhead: l.overhead.unwrap_or(d.overhead),
        };
        check_num(file, &format!("{at}.latency"), link.latency, false)?;
        check_num(file, &format!("{at}.overhead"), link.overhead, false)?;
        check_bw(file, &format!("{at}.bandwidth"), link.bandwidth)?;
        // Between two devices, or else between two regions (device links win).
        let region = |n: &str| region_ids.get(n).map(|&r| r as usize);
        match (seen.get(l.a.as_str()), seen.get(l.b.as_str())) {
            (Some(&i), Some(&j)) => device_links.insert(pair(i, j), link),
            _ => match (region(&l.a), region(&l.b)) {
                (Some(x), Some(y)) => region_links.insert(pair(x, y), link),
                _ => {
                    return Err(Error::input(
                        file,
                        format!(
                            "{at}: joins a device and a region; name two devices or two regions"
                        ),
                    ))
                }
            },
        };
    }
    Ok((region_links, device_links))
}

impl Cluster {
    pub fn load(path: &Path) -> Result<Self> {
        let text = read_file(path)?;
        Self::parse(&path.display().to_string(), &text)
    }

    pub fn parse(file: &str, text: &str) -> Result<Self> {
        let f: ClusterFile = parse_toml(file, text)?;
        Self::resolve(file, &f)
    }

    /// `n` identical devices of speed 1 joined by free links: what uniform-cost runs assume.
    pub fn uniform(n: usize) -> Self {
        let devices = (0..n)
            .map(|i| Device {
                name: format!("w{i}"),
                region: String::new(),
                speed: 1.0,
                memory: None,
                memory_microbatches: None,
            })
            .collect();
        Cluster {
            devices,
            default_link: Link::FREE,
            region_of: vec![0; n],
            region_links: HashMap::new(),
            device_links: HashMap::new(),
            origin: (0..n as u32).collect(),
            regions: 1,
            region_matrix: Vec::new(),
        }
        .with_region_table()
    }

    /// Fill the region table when there are few regions (see [`Cluster::link`]).
    fn with_region_table(mut self) -> Self {
        let r = self.regions;
        self.region_matrix = if r <= REGION_TABLE_MAX {
            (0..r * r)
                .map(|k| {
                    let key = pair(k / r, k % r);
                    self.region_links
                        .get(&key)
                        .copied()
                        .unwrap_or(self.default_link)
                })
                .collect()
        } else {
            Vec::new()
        };
        self
    }

    /// `n` identical devices sharing one link model between every pair.
    pub fn homogeneous(n: usize, link: Link) -> Self {
        Cluster {
            default_link: link,
            ..Self::uniform(n)
        }
        .with_region_table()
    }

    pub fn resolve(file: &str, f: &ClusterFile) -> Result<Self> {
        let d = &f.defaults;
        check_num(file, "defaults.speed", d.speed, true)?;
        check_num(file, "defaults.latency", d.latency, false)?;
        check_num(file, "defaults.overhead", d.overhead, false)?;
        check_bw(file, "defaults.bandwidth", d.bandwidth)?;
        let (devices, seen) = resolve_devices(file, f)?;
        let mut region_ids: HashMap<&str, u32> = HashMap::new();
        let region_of: Vec<u32> = devices
            .iter()
            .map(|d| {
                let next = region_ids.len() as u32;
                *region_ids.entry(d.region.as_str()).or_insert(next)
            })
            .collect();
        let default_link = Link {
            latency: d.latency,
            bandwidth: d.bandwidth,
            overhead: d.overhead,
        };
        for (k, l) in f.links.iter().enumerate() {
            for end in [&l.a, &l.b] {
                if !region_ids.contains_key(end.as_str()) && !seen.contains_key(end.as_str()) {
                    return Err(Error::input(
                        file,
                        format!("links[{k}]: \"{end}\" is neither a device nor a region"),
                    ));
                }
            }
        }
        let (region_links, device_links) = resolve_links(file, f, &seen, &region_ids)?;
        let (n, regions) = (devices.len(), region_ids.len());
        drop(region_ids);
        Ok(Cluster {
            devices,
            default_link,
            region_of,
            region_links,
            device_links,
            origin: (0..n as u32).collect(),
            regions,
            region_matrix: Vec::new(),
        }
        .with_region_table())
    }

    pub fn len(&self) -> usize {
        self.devices.len()
    }
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// For each device, its region's number when its links are its region's alone (no link of
    /// its own to another device, and no copy of it in the cluster), else `None`. Devices of one
    /// region with `Some` reach every other device over the same links.
    pub fn region_linked(&self) -> Vec<Option<u32>> {
        let mut own = vec![false; self.len()];
        for &(a, b) in self.device_links.keys() {
            for d in [a, b] {
                if let Some(x) = own.get_mut(d as usize) {
                    *x = true;
                }
            }
        }
        let mut copies: HashMap<u32, usize> = HashMap::new();
        for &o in &self.origin {
            *copies.entry(o).or_default() += 1;
        }
        (0..self.len())
            .map(|d| (!own[d] && copies[&self.origin[d]] == 1).then_some(self.region_of[d]))
            .collect()
    }

    /// The link from device `from` to device `to` (free to itself, or to a copy of itself
    /// in a subset).
    pub fn link(&self, from: usize, to: usize) -> Link {
        if from == to || self.origin[from] == self.origin[to] {
            return Link::FREE;
        }
        if !self.device_links.is_empty() {
            if let Some(l) = self.device_links.get(&pair(from, to)) {
                return *l;
            }
        }
        let (a, b) = (self.region_of[from] as usize, self.region_of[to] as usize);
        if !self.region_matrix.is_empty() {
            return self.region_matrix[a * self.regions + b];
        }
        self.region_links
            .get(&pair(a, b))
            .copied()
            .unwrap_or(self.default_link)
    }

    /// Seconds to move `bytes` from device `from` to `to` (zero on the same device).
    pub fn transfer_time(&self, from: usize, to: usize, bytes: u64) -> f64 {
        if from == to {
            0.0
        } else {
            self.link(from, to).transfer_time(bytes)
        }
    }

    /// The cluster restricted to the given devices, in that order.
    pub fn subset(&self, ids: &[usize]) -> Cluster {
        let devices = ids.iter().map(|&i| self.devices[i].clone()).collect();
        // Each original device's places in the subset, for its device links.
        let mut places: HashMap<usize, Vec<usize>> = HashMap::new();
        for (new, &old) in ids.iter().enumerate() {
            places.entry(old).or_default().push(new);
        }
        let mut device_links = HashMap::new();
        for (&(a, b), l) in &self.device_links {
            let (Some(pa), Some(pb)) = (places.get(&(a as usize)), places.get(&(b as usize)))
            else {
                continue;
            };
            for &x in pa {
                for &y in pb {
                    device_links.insert(pair(x, y), *l);
                }
            }
        }
        Cluster {
            devices,
            default_link: self.default_link,
            region_of: ids.iter().map(|&i| self.region_of[i]).collect(),
            region_links: self.region_links.clone(),
            device_links,
            origin: ids.iter().map(|&i| self.origin[i]).collect(),
            regions: self.regions,
            region_matrix: self.region_matrix.clone(),
        }
    }
}

fn check_num(file: &str, key: &str, v: f64, positive: bool) -> Result<()> {
    let ok = v.is_finite() && if positive { v > 0.0 } else { v >= 0.0 };
    if ok {
        Ok(())
    } else {
        let want = if positive { "> 0" } else { ">= 0" };
        Err(Error::input(
            file,
            format!("{key} = {v} must be a finite number {want}"),
        ))
    }
}

fn check_bw(file: &str, key: &str, v: f64) -> Result<()> {
    if v.is_nan() || v <= 0.0 {
        Err(Error::input(
            file,
            format!("{key} = {v} must be > 0 bytes per second"),
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Links are sparse: a device pair beats its regions' pair, which beats the default; a
    /// cluster of 100,000 devices costs memory linear in its devices, not their pairs.
    #[test]
    fn links_resolve_most_specific_first_in_linear_memory() {
        let mut toml = String::from("[defaults]\nlatency = 1.0\n");
        for i in 0..100_000 {
            toml += &format!("[[devices]]\nname = \"d{i}\"\nregion = \"r{}\"\n", i % 2);
        }
        toml += "[[links]]\na = \"r0\"\nb = \"r1\"\nlatency = 2.0\n";
        toml += "[[links]]\na = \"d0\"\nb = \"d1\"\nlatency = 3.0\n";
        toml += "[[links]]\na = \"r0\"\nb = \"r0\"\nlatency = 0.5\n";
        let c = Cluster::parse("big.toml", &toml).unwrap();
        assert_eq!(c.link(0, 1).latency, 3.0, "device pair");
        assert_eq!(c.link(1, 0).latency, 3.0, "both ways");
        assert_eq!(c.link(2, 3).latency, 2.0, "region pair");
        assert_eq!(c.link(0, 2).latency, 0.5, "within region r0");
        assert_eq!(c.link(1, 3).latency, 1.0, "default");
        assert_eq!(c.link(5, 5), Link::FREE);
        let sub = c.subset(&[1, 0, 0]);
        assert_eq!(
            sub.link(0, 1).latency,
            3.0,
            "device links follow the subset"
        );
        assert_eq!(sub.link(1, 2), Link::FREE, "a device twice is one device");
        let e =
            Cluster::parse("m.toml", &(toml + "[[links]]\na = \"d0\"\nb = \"r1\"\n")).unwrap_err();
        assert!(e.to_string().contains("joins a device and a region"), "{e}");
    }

    const TWO_NODES: &str = r#"
[defaults]
latency = 0.001
bandwidth = 1000.0
[[devices]]
name = "a0"
region = "r0"
[[devices]]
name = "a1"
region = "r0"
speed = 2.0
[[devices]]
name = "b0"
region = "r1"
[[links]]
a = "r0"
b = "r1"
latency = 0.1
bandwidth = 10.0
"#;

    #[test]
    fn links_resolve_by_region_and_are_symmetric() {
        let c = Cluster::parse("c.toml", TWO_NODES).unwrap();
        assert_eq!(c.devices[1].speed, 2.0);
        assert_eq!(c.transfer_time(0, 0, 100), 0.0);
        assert!((c.transfer_time(0, 1, 100) - 0.101).abs() < 1e-12);
        assert!((c.transfer_time(0, 2, 100) - 10.1).abs() < 1e-12);
        assert!((c.transfer_time(2, 1, 100) - 10.1).abs() < 1e-12);
    }

    #[test]
    fn device_named_twice() {
        let e = Cluster::parse("c.toml", &TWO_NODES.replace("\"b0\"", "\"a0\"")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "c.toml: devices[2]: device \"a0\" is named twice (first at devices[0])"
        );
    }

    #[test]
    fn unknown_key_and_unknown_link_end() {
        let e = Cluster::parse("c.toml", &TWO_NODES.replace("speed = 2.0", "sped = 2.0"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("sped") && e.contains("line 11"), "{e}");
        let e = Cluster::parse("c.toml", &TWO_NODES.replace("b = \"r1\"", "b = \"r9\""))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "c.toml: links[0]: \"r9\" is neither a device nor a region"
        );
    }

    #[test]
    fn negative_values_are_rejected() {
        let e = Cluster::parse(
            "c.toml",
            &TWO_NODES.replace("latency = 0.1", "latency = -0.1"),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "c.toml: links[0] (r0-r1).latency = -0.1 must be a finite number >= 0"
        );
    }
}
