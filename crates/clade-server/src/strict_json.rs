//! Strict JSON request-body parsing: structs must be JSON objects.
//!
//! `serde_json` lets every derived struct also be read from its *sequence form*: for
//! `struct ExecBody { internet: bool }` the body `[false]` parses as `ExecBody { internet: false }`, and for a
//! struct whose fields all have defaults `[]` parses as the all-default value. Derived struct visitors implement
//! `visit_seq`, and `serde_json::Deserializer::deserialize_struct` hands arrays to it. For an HTTP API that is a
//! second, undocumented wire format: it bypasses field names (so a client can set fields by position, including
//! ones it did not mean to), and it makes the accepted input depend on field order.
//!
//! [`from_slice`] behaves exactly like [`serde_json::from_slice`] — same values, same error messages with the same
//! line and column, trailing characters refused — except that a struct (or an enum's struct variant) given as a
//! JSON array is an error such as `invalid type: sequence, expected struct ExecBody at line 1 column 0` (the same
//! wording and position serde_json gives for an array where, say, a bool is expected).
//!
//! It works by wrapping the `serde_json` deserializer. Every call is forwarded unchanged, except that
//! `deserialize_struct` is forwarded as `deserialize_map`, so the struct's own visitor reports the array as an
//! invalid type. Every visitor, seed and access object handed out is wrapped too, so the rule holds at every depth:
//! struct fields, `Vec`/`Option`/map/tuple elements, newtype structs and enum variants.
//!
//! One visible consequence: an array given for a struct is refused on sight, so a syntax error *inside* it (say a
//! truncated `[`) is reported as the invalid type, as serde_json already does for an array given to any non-struct.
//!
//! Limitation: serde's derive *buffers* the input of untagged enums, internally tagged enums, adjacently tagged
//! enums whose content comes before the tag, and `#[serde(flatten)]` fields into a private `Content` tree, then
//! deserializes from that tree with serde's own deserializer, which no wrapper can reach. Structs read from such a
//! buffer still accept arrays: structs in untagged newtype variants, structs nested inside any buffered value, and
//! the `["Tag", field, ...]` form of internally tagged enums. Struct variants of untagged and adjacently tagged
//! enums take only maps in serde itself. The `limitation_*` tests pin down exactly what slips through.

use serde::de::{
    self, DeserializeOwned, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, Unexpected, VariantAccess, Visitor,
};
use std::fmt;

/// Deserializes `T` from JSON bytes like [`serde_json::from_slice`], but refuses the sequence form of structs.
pub fn from_slice<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    // Same steps as `serde_json::from_slice`, so trailing input is refused the same way.
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = T::deserialize(Strict(&mut de))?;
    de.end()?;
    Ok(value)
}

/// A deserializer that forwards to `D` but reads structs only from maps.
struct Strict<D>(D);

/// Wraps a visitor so that whatever it is given to read nested values from is wrapped in turn.
struct StrictVisitor<V> {
    inner: V,
    /// Set when the visitor belongs to a struct, for inputs that could still hand it a sequence.
    refuse_seq: bool,
}

impl<V> StrictVisitor<V> {
    fn new(inner: V) -> Self {
        StrictVisitor { inner, refuse_seq: false }
    }

    fn for_struct(inner: V) -> Self {
        StrictVisitor { inner, refuse_seq: true }
    }
}

/// Wraps a seed so that it deserializes from a [`Strict`] deserializer.
struct StrictSeed<S>(S);

struct StrictSeqAccess<A>(A);

struct StrictMapAccess<A>(A);

struct StrictEnumAccess<A>(A);

struct StrictVariantAccess<A>(A);

/// Forwards `deserialize_*` methods that take only a visitor.
macro_rules! forward_visitor_only {
    ($($method:ident)*) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
                self.0.$method(StrictVisitor::new(visitor))
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Strict<D> {
    type Error = D::Error;

    forward_visitor_only! {
        deserialize_any deserialize_bool
        deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128
        deserialize_f32 deserialize_f64 deserialize_char deserialize_str deserialize_string
        deserialize_bytes deserialize_byte_buf deserialize_option deserialize_unit
        deserialize_seq deserialize_map deserialize_identifier
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_unit_struct(name, StrictVisitor::new(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_newtype_struct(name, StrictVisitor::new(visitor))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple(len, StrictVisitor::new(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(self, name: &'static str, len: usize, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple_struct(name, len, StrictVisitor::new(visitor))
    }

    /// The one real change: a struct is read as a map, so an array meets the visitor's "invalid type" error,
    /// worded by the struct's own `expecting` and positioned as serde_json positions every other invalid-type error
    /// on a `[` (the column before it), instead of reaching the struct's `visit_seq`.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(StrictVisitor::for_struct(visitor))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_enum(name, variants, StrictVisitor::new(visitor))
    }

    /// Skipped input builds no struct, so there is nothing to guard; passing the visitor bare saves the wrapping.
    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_ignored_any(visitor)
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

/// Forwards `visit_*` methods for scalar values one-to-one, so the inner visitor's own conversions and error
/// messages apply rather than the `Visitor` trait's defaults.
macro_rules! forward_scalar_visits {
    ($($method:ident($ty:ty))*) => {
        $(
            fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
                self.inner.$method(v)
            }
        )*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for StrictVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(formatter)
    }

    forward_scalar_visits! {
        visit_bool(bool)
        visit_i8(i8) visit_i16(i16) visit_i32(i32) visit_i64(i64) visit_i128(i128)
        visit_u8(u8) visit_u16(u16) visit_u32(u32) visit_u64(u64) visit_u128(u128)
        visit_f32(f32) visit_f64(f64) visit_char(char)
        visit_str(&str) visit_borrowed_str(&'de str) visit_string(String)
        visit_bytes(&[u8]) visit_borrowed_bytes(&'de [u8]) visit_byte_buf(Vec<u8>)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        self.inner.visit_some(Strict(deserializer))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        self.inner.visit_newtype_struct(Strict(deserializer))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        if self.refuse_seq {
            // Reached only where the input format chose `visit_seq` for a struct on its own (a struct variant);
            // the error reads as the struct's visitor would word it.
            return Err(de::Error::invalid_type(Unexpected::Seq, &self));
        }
        self.inner.visit_seq(StrictSeqAccess(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        self.inner.visit_map(StrictMapAccess(map))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Self::Value, A::Error> {
        self.inner.visit_enum(StrictEnumAccess(data))
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for StrictSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(Strict(deserializer))
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for StrictSeqAccess<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(StrictSeed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for StrictMapAccess<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        self.0.next_key_seed(StrictSeed(seed))
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.0.next_value_seed(StrictSeed(seed))
    }

    // Forwarded rather than left to the default so an inner override (if any) is kept.
    fn next_entry_seed<K: DeserializeSeed<'de>, T: DeserializeSeed<'de>>(
        &mut self,
        key: K,
        value: T,
    ) -> Result<Option<(K::Value, T::Value)>, A::Error> {
        self.0.next_entry_seed(StrictSeed(key), StrictSeed(value))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for StrictEnumAccess<A> {
    type Error = A::Error;
    type Variant = StrictVariantAccess<A::Variant>;

    fn variant_seed<S: DeserializeSeed<'de>>(self, seed: S) -> Result<(S::Value, Self::Variant), A::Error> {
        let (value, variant) = self.0.variant_seed(StrictSeed(seed))?;
        Ok((value, StrictVariantAccess(variant)))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for StrictVariantAccess<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.0.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.0.newtype_variant_seed(StrictSeed(seed))
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.0.tuple_variant(len, StrictVisitor::new(visitor))
    }

    /// serde_json reads the variant's body with its own `deserialize_struct`, which we cannot reroute to
    /// `deserialize_map` from here; the struct visitor refuses a sequence itself instead. serde_json has consumed
    /// the `[` by then, so the error's column is that of the `[`, one more than in the `deserialize_struct` case.
    fn struct_variant<V: Visitor<'de>>(self, fields: &'static [&'static str], visitor: V) -> Result<V::Value, A::Error> {
        self.0.struct_variant(fields, StrictVisitor::for_struct(visitor))
    }
}

#[cfg(test)]
mod tests {
    use super::from_slice;
    use serde::de::DeserializeOwned;
    use serde::Deserialize;
    use serde_json::{json, Map, Value};
    use std::collections::{BTreeMap, HashMap};
    use std::fmt::Debug;

    #[derive(Debug, PartialEq, Deserialize)]
    struct ExecBody {
        internet: bool,
    }

    #[derive(Debug, Default, PartialEq, Deserialize)]
    #[serde(default)]
    struct Options {
        timeout: Option<u64>,
        name: Option<String>,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Outer {
        id: u32,
        body: ExecBody,
    }

    fn err<T: DeserializeOwned + Debug>(input: &str) -> String {
        match from_slice::<T>(input.as_bytes()) {
            Ok(value) => panic!("{input:?} was accepted as {value:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn ok<T: DeserializeOwned>(input: &str) -> T {
        match from_slice::<T>(input.as_bytes()) {
            Ok(value) => value,
            Err(e) => panic!("{input:?} was refused: {e}"),
        }
    }

    /// Asserts that the strict parser and plain serde_json agree on `input`: same value or same error text.
    fn assert_same<T: DeserializeOwned + PartialEq + Debug>(input: &str) {
        let strict = from_slice::<T>(input.as_bytes()).map_err(|e| e.to_string());
        let plain = serde_json::from_slice::<T>(input.as_bytes()).map_err(|e| e.to_string());
        assert_eq!(strict, plain, "input {input:?}");
    }

    #[test]
    fn top_level_struct_as_array_is_refused() {
        // The loophole being closed: plain serde_json takes the array.
        assert_eq!(serde_json::from_slice::<ExecBody>(b"[false]").ok(), Some(ExecBody { internet: false }));
        assert_eq!(err::<ExecBody>("[false]"), "invalid type: sequence, expected struct ExecBody at line 1 column 0");
        // Same position convention as serde_json's own invalid-type errors on an array.
        assert_eq!(
            serde_json::from_slice::<bool>(b"[false]").map_err(|e| e.to_string()),
            Err("invalid type: sequence, expected a boolean at line 1 column 0".to_owned())
        );
        assert_eq!(err::<ExecBody>("  [true]"), "invalid type: sequence, expected struct ExecBody at line 1 column 2");
    }

    #[test]
    fn empty_array_for_all_default_struct_is_refused() {
        assert_eq!(serde_json::from_slice::<Options>(b"[]").ok(), Some(Options::default()));
        assert_eq!(err::<Options>("[]"), "invalid type: sequence, expected struct Options at line 1 column 0");
        assert_eq!(ok::<Options>("{}"), Options::default());
    }

    #[test]
    fn object_is_accepted() {
        assert_eq!(ok::<ExecBody>(r#"{"internet": true}"#), ExecBody { internet: true });
        assert_eq!(ok::<Options>(r#"{"timeout": 5}"#), Options { timeout: Some(5), name: None });
        assert_same::<ExecBody>(r#"{"internet": true, "extra": [1, {"a": []}]}"#);
    }

    #[test]
    fn nested_struct_field_as_array_is_refused() {
        assert_eq!(err::<Outer>(r#"{"id": 1, "body": [true]}"#), "invalid type: sequence, expected struct ExecBody at line 1 column 18");
        assert_eq!(ok::<Outer>(r#"{"id": 1, "body": {"internet": true}}"#), Outer { id: 1, body: ExecBody { internet: true } });
    }

    #[test]
    fn vec_of_structs_refuses_arrays_but_vec_of_numbers_is_fine() {
        assert_eq!(
            err::<Vec<ExecBody>>(r#"[{"internet": true}, [false]]"#),
            "invalid type: sequence, expected struct ExecBody at line 1 column 21"
        );
        assert_eq!(ok::<Vec<ExecBody>>(r#"[{"internet": false}]"#), vec![ExecBody { internet: false }]);
        assert_eq!(ok::<Vec<u32>>("[1, 2, 3]"), vec![1, 2, 3]);
        assert_eq!(ok::<Vec<Vec<u32>>>("[[1], []]"), vec![vec![1], vec![]]);
        assert!(err::<Vec<Box<ExecBody>>>("[[true]]").starts_with("invalid type: sequence, expected struct ExecBody"));
    }

    #[test]
    fn option_of_struct_refuses_array_and_takes_null() {
        assert_eq!(ok::<Option<ExecBody>>("null"), None);
        assert_eq!(ok::<Option<ExecBody>>(r#"{"internet": true}"#), Some(ExecBody { internet: true }));
        assert_eq!(err::<Option<ExecBody>>("[true]"), "invalid type: sequence, expected struct ExecBody at line 1 column 0");

        #[derive(Debug, Deserialize)]
        struct Holder {
            #[allow(dead_code)]
            inner: Option<ExecBody>,
        }
        assert!(err::<Holder>(r#"{"inner": [true]}"#).starts_with("invalid type: sequence, expected struct ExecBody"));
        assert!(ok::<Holder>(r#"{"inner": null}"#).inner.is_none());
    }

    #[test]
    fn map_values_refuse_arrays() {
        assert_eq!(
            err::<BTreeMap<String, ExecBody>>(r#"{"a": {"internet": true}, "b": [false]}"#),
            "invalid type: sequence, expected struct ExecBody at line 1 column 31"
        );
        assert!(err::<HashMap<String, ExecBody>>(r#"{"b": [false]}"#).starts_with("invalid type: sequence, expected struct ExecBody"));
        let map = ok::<BTreeMap<String, ExecBody>>(r#"{"a": {"internet": true}}"#);
        assert_eq!(map.get("a"), Some(&ExecBody { internet: true }));
        // Keys are still read as serde_json reads them, numeric keys included.
        assert_same::<BTreeMap<u32, Vec<u8>>>(r#"{"1": [1, 2], "2": []}"#);
        assert_same::<BTreeMap<u32, u8>>(r#"{"x": 1}"#);
    }

    #[test]
    fn tuples_and_newtype_structs_are_guarded_too() {
        #[derive(Debug, PartialEq, Deserialize)]
        struct Wrapper(ExecBody);
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(transparent)]
        struct Transparent {
            body: ExecBody,
        }
        #[derive(Debug, PartialEq, Deserialize)]
        struct Pair(u32, String);

        assert_eq!(err::<Wrapper>("[true]"), "invalid type: sequence, expected struct ExecBody at line 1 column 0");
        assert_eq!(ok::<Wrapper>(r#"{"internet": true}"#), Wrapper(ExecBody { internet: true }));
        assert!(err::<Transparent>("[true]").starts_with("invalid type: sequence, expected struct ExecBody"));
        assert!(err::<(u32, ExecBody)>("[1, [true]]").starts_with("invalid type: sequence, expected struct ExecBody"));
        // Tuple structs and tuples are sequences by nature and stay so.
        assert_eq!(ok::<Pair>(r#"[1, "a"]"#), Pair(1, "a".to_owned()));
        assert_same::<(u32, bool)>("[1, true]");
    }

    #[test]
    fn json_values_accept_anything() {
        #[derive(Debug, PartialEq, Deserialize)]
        struct Free {
            any: Value,
            map: Map<String, Value>,
        }
        let free = ok::<Free>(r#"{"any": [1, [2, {"x": []}]], "map": {"k": [false], "n": null}}"#);
        assert_eq!(free.any, json!([1, [2, {"x": []}]]));
        assert_eq!(free.map.get("k"), Some(&json!([false])));
        assert_same::<Value>(r#"[{"a": [1, 2.5, -3, "s", null, true]}, [], {}]"#);
        assert_same::<Value>(r#"{"big": 18446744073709551615, "neg": -9223372036854775808, "f": 1e400}"#);
        assert_same::<Map<String, Value>>("[1]");
    }

    #[test]
    fn deny_unknown_fields_still_works() {
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Closed {
            a: u8,
        }
        assert_eq!(ok::<Closed>(r#"{"a": 1}"#), Closed { a: 1 });
        assert_eq!(err::<Closed>(r#"{"a": 1, "b": 2}"#), "unknown field `b`, expected `a` at line 1 column 12");
        assert_same::<Closed>(r#"{"a": 1, "b": 2}"#);
        assert_eq!(err::<Closed>("[1]"), "invalid type: sequence, expected struct Closed at line 1 column 0");
    }

    #[test]
    fn rename_alias_and_flatten_still_work() {
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Renamed {
            max_count: u32,
            #[serde(alias = "old_name")]
            new_name: String,
        }
        #[derive(Debug, PartialEq, Deserialize)]
        struct Flat {
            id: u32,
            #[serde(flatten)]
            rest: Renamed,
            #[serde(flatten)]
            extra: BTreeMap<String, Value>,
        }
        assert_eq!(ok::<Renamed>(r#"{"maxCount": 3, "old_name": "x"}"#), Renamed { max_count: 3, new_name: "x".to_owned() });
        assert_same::<Renamed>(r#"{"max_count": 3, "newName": "x"}"#);
        let flat = ok::<Flat>(r#"{"id": 1, "maxCount": 2, "newName": "n", "other": [1]}"#);
        assert_eq!(flat.rest.max_count, 2);
        assert_eq!(flat.extra.get("other"), Some(&json!([1])));
        // A struct with flattened fields is read as a map by the derive itself; arrays were never taken there.
        assert_same::<Flat>(r#"[1, 2, "n"]"#);
        assert_eq!(err::<Flat>("[1]"), "invalid type: sequence, expected struct Flat at line 1 column 0");
    }

    #[derive(Debug, PartialEq, Deserialize)]
    enum Command {
        Stop,
        Wait(u32),
        Move(i32, i32),
        Exec { internet: bool },
        Run(ExecBody),
    }

    #[test]
    fn externally_tagged_enum_refuses_struct_variant_as_array() {
        assert_eq!(serde_json::from_slice::<Command>(br#"{"Exec": [true]}"#).ok(), Some(Command::Exec { internet: true }));
        assert_eq!(
            err::<Command>(r#"{"Exec": [true]}"#),
            "invalid type: sequence, expected struct variant Command::Exec at line 1 column 10"
        );
        assert_eq!(ok::<Command>(r#"{"Exec": {"internet": true}}"#), Command::Exec { internet: true });
        assert!(err::<Command>(r#"{"Run": [true]}"#).starts_with("invalid type: sequence, expected struct ExecBody"));
        assert_eq!(ok::<Command>(r#"{"Run": {"internet": false}}"#), Command::Run(ExecBody { internet: false }));
        for input in [
            r#""Stop""#,
            r#"{"Wait": 5}"#,
            r#"{"Move": [1, -2]}"#,
            r#""Exec""#,
            r#""Nope""#,
            r#"{"Exec": {"internet": true}, "Stop": null}"#,
            r#"{"Exec": {"internet": 1}}"#,
            r#"{"Exec": null}"#,
            "[]",
        ] {
            assert_same::<Command>(input);
        }
    }

    #[test]
    fn scalars_behave_exactly_like_serde_json() {
        for input in ["true", "false", "0", "1", "\"true\"", "null", "[]", "{}"] {
            assert_same::<bool>(input);
        }
        for input in ["9223372036854775807", "-9223372036854775808", "9223372036854775808", "-9223372036854775809"] {
            assert_same::<i64>(input);
        }
        for input in ["18446744073709551615", "18446744073709551616", "-1", "1.5", "1e3"] {
            assert_same::<u64>(input);
        }
        for input in ["255", "256", "-129", "127"] {
            assert_same::<u8>(input);
            assert_same::<i8>(input);
        }
        for input in ["170141183460469231731687303715884105727", "-170141183460469231731687303715884105728"] {
            assert_same::<i128>(input);
            assert_same::<u128>(input);
        }
        for input in ["1.5", "-0.0", "1e308", "1e400", "3", "\"1\""] {
            assert_same::<f64>(input);
            assert_same::<f32>(input);
        }
        for input in [r#""plain""#, r#""esc\n\u00e9\ud83d\ude00""#, r#""\ud800""#, "5", r#""ab""#] {
            assert_same::<String>(input);
            assert_same::<char>(input);
        }
        assert_same::<()>("null");
        assert_same::<()>("0");
        assert_same::<Option<u8>>("null");
        assert_same::<Option<u8>>("300");
        assert_eq!(ok::<i64>("-9223372036854775808"), i64::MIN);
        assert_eq!(ok::<i64>("9223372036854775807"), i64::MAX);
    }

    #[test]
    fn ordinary_error_messages_are_serde_jsons() {
        assert_eq!(err::<ExecBody>(r#"{"internet": "yes"}"#), r#"invalid type: string "yes", expected a boolean at line 1 column 18"#);
        assert_same::<ExecBody>(r#"{"internet": "yes"}"#);
        assert_eq!(err::<ExecBody>(r#"{"internet": true} x"#), "trailing characters at line 1 column 20");
        assert_same::<ExecBody>(r#"{"internet": true} x"#);
        assert_eq!(err::<ExecBody>("{}"), "missing field `internet` at line 1 column 2");
        assert_same::<ExecBody>("{}");
        assert_same::<ExecBody>(r#"{"internet": true, "internet": false}"#);
        assert_same::<ExecBody>(r#""text""#);
        assert_same::<ExecBody>("null");
        assert_same::<ExecBody>("");
        assert_same::<ExecBody>("12");
    }

    #[test]
    fn errors_keep_line_and_column() {
        let input = "{\n  \"id\": 1,\n  \"body\": [\n    true\n  ]\n}";
        let e = match from_slice::<Outer>(input.as_bytes()) {
            Ok(v) => panic!("accepted {v:?}"),
            Err(e) => e,
        };
        assert_eq!((e.line(), e.column()), (3, 10));
        assert!(e.is_data());

        let input = "{\n  \"id\": 1,\n  \"body\": {\"internet\": 7}\n}";
        assert_same::<Outer>(input);
        let e = match from_slice::<Outer>(input.as_bytes()) {
            Ok(v) => panic!("accepted {v:?}"),
            Err(e) => e,
        };
        assert_eq!((e.line(), e.column()), (3, 24));
        assert!(e.is_data());

        let e = match from_slice::<Outer>(b"{\"id\": 1,\n \"body\": {") {
            Ok(v) => panic!("accepted {v:?}"),
            Err(e) => e,
        };
        assert!(e.is_eof());
        assert_eq!(e.line(), 2);
    }

    #[test]
    fn malformed_input_never_panics() {
        let deep_ok = format!("{}{}", "[".repeat(127), "]".repeat(127));
        let deep_too_far = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let deep_objects = "{\"a\":".repeat(200);
        let inputs: Vec<&[u8]> = vec![
            b"",
            b"   ",
            b"{",
            b"[",
            b"{\"internet\"",
            b"{\"internet\":",
            b"{\"internet\": tru",
            b"{\"internet\": true,",
            b"{\"internet\": true,}",
            b"[true,",
            b"\"unterminated",
            b"\xff\xfe",
            b"{\"\xff\": 1}",
            b"1e999999999",
            b"-",
            b"}",
            b"]",
            deep_ok.as_bytes(),
            deep_too_far.as_bytes(),
            deep_objects.as_bytes(),
        ];
        for input in inputs {
            let text = String::from_utf8_lossy(input);
            if text.trim_start().starts_with('[') {
                // The array is refused on sight, before serde_json would have found the syntax error inside it;
                // serde_json does the same for an array given to any non-struct type.
                assert!(err::<ExecBody>(&text).starts_with("invalid type: sequence, expected struct ExecBody"));
            } else {
                assert_same::<ExecBody>(&text);
            }
            assert_same::<Value>(&text);
            assert_same::<Command>(&text);
            let _ = from_slice::<Outer>(input);
            let _ = from_slice::<Vec<Option<ExecBody>>>(input);
            let _ = from_slice::<BTreeMap<String, Options>>(input);
        }
        assert_same::<Value>(&deep_ok);
        assert!(err::<Value>(&deep_too_far).starts_with("recursion limit exceeded"));
    }

    #[test]
    fn recursion_limit_matches_serde_json_for_nested_structs() {
        #[derive(Debug, PartialEq, Deserialize)]
        struct Node {
            child: Option<Box<Node>>,
        }
        for depth in [1, 100, 127, 128, 129, 300] {
            let input = format!("{}null{}", "{\"child\":".repeat(depth), "}".repeat(depth));
            assert_same::<Node>(&input);
        }
        let nested_array = format!("{}{}", "{\"child\":".repeat(50), "[null]");
        assert!(err::<Node>(&nested_array).starts_with("invalid type: sequence, expected struct Node"));
    }

    // The tests below pin down what the wrapper cannot reach: serde's derive first buffers the input of these
    // types into its private `Content` tree and then reads the struct from that buffer with its own deserializer,
    // whose `deserialize_struct` still takes sequences. Everything read directly from the JSON text stays guarded.

    #[test]
    fn limitation_untagged_enum_structs_accept_arrays() {
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(untagged)]
        enum Either {
            Body(ExecBody),
            Number(u32),
            Inline { internet: bool, name: String },
        }
        assert_eq!(ok::<Either>("[true]"), Either::Body(ExecBody { internet: true }));
        assert_eq!(ok::<Either>(r#"{"internet": true}"#), Either::Body(ExecBody { internet: true }));
        assert_eq!(ok::<Either>("4"), Either::Number(4));
        // Untagged *struct* variants take only maps; serde itself refuses `[true, "n"]` for `Inline`.
        assert_same::<Either>(r#"[true, "n"]"#);
        assert_eq!(err::<Either>(r#"[true, "n"]"#), "data did not match any variant of untagged enum Either");
        // An untagged enum nested *inside* a guarded struct still reads its own variants from the buffer...
        #[derive(Debug, PartialEq, Deserialize)]
        struct Holder {
            either: Either,
        }
        assert_eq!(ok::<Holder>(r#"{"either": [false]}"#).either, Either::Body(ExecBody { internet: false }));
        // ...but the guarded struct around it is still refused as an array.
        assert!(err::<Holder>("[4]").starts_with("invalid type: sequence, expected struct Holder"));
    }

    #[test]
    fn limitation_internally_tagged_enum_accepts_arrays() {
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(tag = "type")]
        enum Tagged {
            Exec { internet: bool },
            Nested { body: ExecBody },
            Pair { x: u8, y: u8 },
        }
        // The enum's own sequence form (tag first) and structs inside the buffered variant both slip through.
        assert_eq!(ok::<Tagged>(r#"["Exec", true]"#), Tagged::Exec { internet: true });
        assert_eq!(ok::<Tagged>(r#"["Pair", 1, 2]"#), Tagged::Pair { x: 1, y: 2 });
        assert_eq!(ok::<Tagged>(r#"{"type": "Nested", "body": [true]}"#), Tagged::Nested { body: ExecBody { internet: true } });
        assert_eq!(ok::<Tagged>(r#"{"type": "Exec", "internet": false}"#), Tagged::Exec { internet: false });
    }

    #[test]
    fn limitation_adjacently_tagged_newtype_variant_depends_on_key_order() {
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(tag = "t", content = "c")]
        enum Adjacent {
            Exec { internet: bool },
            Run(ExecBody),
        }
        // Tag first: the content is read straight from the JSON text and the array is refused.
        assert_eq!(err::<Adjacent>(r#"{"t": "Run", "c": [true]}"#), "invalid type: sequence, expected struct ExecBody at line 1 column 18");
        // Content first: it is buffered before the tag is known, and the array slips through.
        assert_eq!(ok::<Adjacent>(r#"{"c": [true], "t": "Run"}"#), Adjacent::Run(ExecBody { internet: true }));
        // Adjacently tagged *struct* variants take only maps in either order; serde itself refuses arrays there.
        assert_same::<Adjacent>(r#"{"t": "Exec", "c": [true]}"#);
        assert_same::<Adjacent>(r#"{"c": [true], "t": "Exec"}"#);
        assert!(err::<Adjacent>(r#"{"c": [true], "t": "Exec"}"#).starts_with("invalid type: sequence"));
    }

    #[test]
    fn limitation_structs_inside_flattened_fields_accept_arrays() {
        #[derive(Debug, PartialEq, Deserialize)]
        struct Inner {
            body: ExecBody,
        }
        #[derive(Debug, PartialEq, Deserialize)]
        struct Outer2 {
            id: u32,
            direct: Option<ExecBody>,
            #[serde(flatten)]
            inner: Inner,
        }
        // A field of the flattened struct is buffered, so its array form slips through...
        assert_eq!(ok::<Outer2>(r#"{"id": 1, "body": [true]}"#).inner.body, ExecBody { internet: true });
        // ...while the outer struct's own fields are read directly and stay guarded.
        assert!(err::<Outer2>(r#"{"id": 1, "direct": [true], "body": {"internet": true}}"#)
            .starts_with("invalid type: sequence, expected struct ExecBody"));
    }
}
