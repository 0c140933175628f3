//! Five-field cron expressions for scheduled function runs (`0 9 * * *`, as in
//! PandaStack's schedules), evaluated on the wall clock of UTC or an IANA time zone.
//!
//! Schedules are stored as text and re-parsed, so the parser is strict: anything it
//! accepts has one meaning, and anything that can never fire is refused up front
//! rather than silently never running.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Datelike, NaiveDate, TimeZone, Timelike};
use chrono_tz::Tz;

/// Real schedules are short; the bound keeps a hostile expression cheap to refuse.
const MAX_EXPRESSION_CHARS: usize = 256;

/// How many years `next_after` looks ahead. The Gregorian calendar repeats exactly every
/// 400 years (146 097 days, a whole number of weeks), so an expression that fires at all
/// fires within any such window — even `0 0 29 2 */7` (Feb 29 on a Sunday), which can
/// go 40 years between firings, far beyond the 8 years that cover leap days alone.
const SEARCH_YEARS: i32 = 401;

/// The fixed instant (1970-01-01 UTC) from which `parse` checks that an expression fires.
const NEVER_FIRES_PROBE_MS: i64 = 0;

const MINUTE_MS: i64 = 60_000;

/// What one of the five fields accepts.
struct FieldSpec {
    name: &'static str,
    min: u32,
    max: u32,
    /// Where `*` and `a/n` stop. Only day-of-week differs from `max`: 7 is accepted as a
    /// second Sunday, but `1/2` should mean Mon, Wed, Fri, not also Sunday.
    open_end: u32,
    /// Three-letter names of `min`, `min + 1`, …
    names: &'static [&'static str],
}

const MINUTE: FieldSpec = FieldSpec { name: "minute", min: 0, max: 59, open_end: 59, names: &[] };
const HOUR: FieldSpec = FieldSpec { name: "hour", min: 0, max: 23, open_end: 23, names: &[] };
const DAY_OF_MONTH: FieldSpec = FieldSpec { name: "day-of-month", min: 1, max: 31, open_end: 31, names: &[] };
const MONTH_NAMES: [&str; 12] = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];
const MONTH: FieldSpec = FieldSpec { name: "month", min: 1, max: 12, open_end: 12, names: &MONTH_NAMES };
const DAY_OF_WEEK: FieldSpec =
    FieldSpec { name: "day-of-week", min: 0, max: 7, open_end: 6, names: &["sun", "mon", "tue", "wed", "thu", "fri", "sat"] };

/// Why an expression or time zone was refused; the messages are shown to users as-is.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CronError {
    #[error("cron expression is {length} characters long; at most {limit} are allowed", limit = MAX_EXPRESSION_CHARS)]
    TooLong { length: usize },
    #[error("cron expression needs 5 fields (minute hour day-of-month month day-of-week), found {found}")]
    FieldCount { found: usize },
    #[error("unknown cron macro `{name}`; use @yearly, @annually, @monthly, @weekly, @daily, @midnight or @hourly")]
    UnknownMacro { name: String },
    #[error("the {field} field has an empty item in its comma-separated list")]
    EmptyListItem { field: &'static str },
    #[error("the {field} field's `{item}` is not a number, name, range or step")]
    InvalidItem { field: &'static str, item: String },
    #[error("the {field} field's value {value} is out of its range {min}-{max}")]
    OutOfRange { field: &'static str, value: String, min: u32, max: u32 },
    #[error("the {field} field's step `{step}` must be a whole number of at least 1")]
    InvalidStep { field: &'static str, step: String },
    #[error("the {field} field's range {start}-{end} starts after it ends")]
    BackwardRange { field: &'static str, start: u32, end: u32 },
    #[error("cron expression `{expression}` can never fire: no date matches its day and month fields")]
    NeverFires { expression: String },
    #[error("unknown time zone `{name}`; use an IANA name such as `Europe/Paris` or `UTC`")]
    UnknownTimeZone { name: String },
}

/// A parsed 5-field cron expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    /// As given, normalised, so `Display` shows what the user wrote.
    expression: String,
    // Bit `n` set = value `n` matches; day-of-week's Sunday is bit 0 only.
    minutes: u64,
    hours: u64,
    days_of_month: u64,
    months: u64,
    days_of_week: u64,
    /// Vixie cron's rule, which users expect: when both day fields are restricted (neither
    /// starts with `*`), either may match (`0 0 13 * 5`: the 13th, and every Friday);
    /// otherwise both must.
    either_day_field_matches: bool,
}

/// A wall-clock minute being searched. Fields may overflow (minute 60, day 32, month 13):
/// the search treats "no match from here" and overflow alike, by moving to the next unit.
#[derive(Debug, Clone, Copy)]
struct WallClock {
    year: i32,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
}

impl Cron {
    /// Parses `minute hour day-of-month month day-of-week` (each a comma list of `*`, `n`,
    /// `a-b`, `*/n`, `a-b/n` or `a/n`; month and weekday also by name) or a macro such
    /// as `@daily`. Errors name the first bad field, in field order.
    pub fn parse(expression: &str) -> Result<Cron, CronError> {
        let trimmed = expression.trim();
        let length = trimmed.chars().count();
        if length > MAX_EXPRESSION_CHARS {
            return Err(CronError::TooLong { length });
        }
        let is_macro = trimmed.starts_with('@');
        let fields: Vec<&str> = if is_macro { macro_fields(trimmed)? } else { trimmed }.split_whitespace().collect();
        let [minute, hour, day_of_month, month, day_of_week] = fields.as_slice() else {
            return Err(CronError::FieldCount { found: fields.len() });
        };
        let cron = Cron {
            minutes: parse_field(minute, &MINUTE)?,
            hours: parse_field(hour, &HOUR)?,
            days_of_month: parse_field(day_of_month, &DAY_OF_MONTH)?,
            months: parse_field(month, &MONTH)?,
            // 7 is Sunday too: fold it onto 0 so matching has one bit per weekday.
            days_of_week: parse_field(day_of_week, &DAY_OF_WEEK).map(|bits| (bits & 0x7f) | ((bits >> 7) & 1))?,
            either_day_field_matches: !day_of_month.starts_with('*') && !day_of_week.starts_with('*'),
            expression: if is_macro { trimmed.to_string() } else { fields.join(" ") },
        };
        if cron.next_after(NEVER_FIRES_PROBE_MS, Tz::UTC).is_none() {
            return Err(CronError::NeverFires { expression: cron.expression });
        }
        Ok(cron)
    }

    /// The first instant strictly after `after_ms` (Unix milliseconds) at which it fires,
    /// as Unix milliseconds (always a whole minute), in time zone `tz`. None only if it
    /// never fires (parse already refuses those, so in practice always Some). Whole minutes
    /// because today's UTC offsets are; only historical local mean times (Paris before 1911) are not.
    ///
    /// Matching is on `tz`'s wall clock, as users think of schedules: a local time that a
    /// DST gap skips does not fire, and one the autumn fold repeats fires once, at the
    /// earlier instant.
    pub fn next_after(&self, after_ms: i64, tz: Tz) -> Option<i64> {
        let first_minute_ms = after_ms.div_euclid(MINUTE_MS).checked_add(1)?.checked_mul(MINUTE_MS)?;
        let local = DateTime::from_timestamp_millis(first_minute_ms)?.with_timezone(&tz).naive_local();
        let mut cursor =
            WallClock { year: local.year(), month: local.month(), day: local.day(), hour: local.hour(), minute: local.minute() };
        let last_year = cursor.year.checked_add(SEARCH_YEARS)?;
        loop {
            let found = self.next_wall_clock_match(cursor, last_year)?;
            let naive = NaiveDate::from_ymd_opt(found.year, found.month, found.day)?.and_hms_opt(found.hour, found.minute, 0)?;
            // `earliest` is None in a DST gap and the earlier instant in a fold. A fold's
            // minute whose earlier instant is not after `after_ms` already fired (we are in
            // the repeated hour's second pass), so it is skipped too.
            let instant = tz.from_local_datetime(&naive).earliest();
            if let Some(ms) = instant.map(|instant| instant.timestamp_millis()).filter(|&ms| ms > after_ms) {
                return Some(ms);
            }
            cursor = WallClock { minute: found.minute + 1, ..found };
        }
    }

    /// The first matching wall-clock minute at or after `cursor`, skipping whole months,
    /// days and hours that cannot match, so a search over years takes few steps.
    fn next_wall_clock_match(&self, mut cursor: WallClock, last_year: i32) -> Option<WallClock> {
        while cursor.year <= last_year {
            let Some(month) = next_set_bit(self.months, cursor.month) else {
                cursor = WallClock { year: cursor.year + 1, month: 1, day: 1, hour: 0, minute: 0 };
                continue;
            };
            if month != cursor.month {
                cursor = WallClock { month, day: 1, hour: 0, minute: 0, ..cursor };
            }
            let Some(date) = NaiveDate::from_ymd_opt(cursor.year, cursor.month, cursor.day) else {
                cursor = WallClock { month: cursor.month + 1, day: 1, hour: 0, minute: 0, ..cursor };
                continue;
            };
            if !self.day_matches(date) {
                // When both day fields must match, jump straight to the next day-of-month.
                let day = if self.either_day_field_matches {
                    cursor.day + 1
                } else {
                    next_set_bit(self.days_of_month, cursor.day + 1).unwrap_or(32)
                };
                cursor = WallClock { day, hour: 0, minute: 0, ..cursor };
                continue;
            }
            let Some(hour) = next_set_bit(self.hours, cursor.hour) else {
                cursor = WallClock { day: cursor.day + 1, hour: 0, minute: 0, ..cursor };
                continue;
            };
            if hour != cursor.hour {
                cursor = WallClock { hour, minute: 0, ..cursor };
            }
            let Some(minute) = next_set_bit(self.minutes, cursor.minute) else {
                cursor = WallClock { hour: cursor.hour + 1, minute: 0, ..cursor };
                continue;
            };
            return Some(WallClock { minute, ..cursor });
        }
        None
    }

    fn day_matches(&self, date: NaiveDate) -> bool {
        let by_month_day = (self.days_of_month >> date.day()) & 1 == 1;
        let by_weekday = (self.days_of_week >> date.weekday().num_days_from_sunday()) & 1 == 1;
        if self.either_day_field_matches {
            by_month_day || by_weekday
        } else {
            by_month_day && by_weekday
        }
    }
}

impl FromStr for Cron {
    type Err = CronError;

    fn from_str(expression: &str) -> Result<Cron, CronError> {
        Cron::parse(expression)
    }
}

impl fmt::Display for Cron {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.expression)
    }
}

/// An IANA time zone name (`Europe/Paris`, `UTC`); a clear error naming the bad name otherwise.
pub fn parse_timezone(name: &str) -> Result<Tz, CronError> {
    name.parse::<Tz>().map_err(|_| CronError::UnknownTimeZone { name: name.to_string() })
}

/// The five fields a macro stands for.
fn macro_fields(name: &str) -> Result<&'static str, CronError> {
    match name.to_ascii_lowercase().as_str() {
        "@yearly" | "@annually" => Ok("0 0 1 1 *"),
        "@monthly" => Ok("0 0 1 * *"),
        "@weekly" => Ok("0 0 * * 0"),
        "@daily" | "@midnight" => Ok("0 0 * * *"),
        "@hourly" => Ok("0 * * * *"),
        _ => Err(CronError::UnknownMacro { name: name.to_string() }),
    }
}

/// The lowest set bit of `bits` at position `from` or above.
fn next_set_bit(bits: u64, from: u32) -> Option<u32> {
    let remaining = bits.checked_shr(from)?.checked_shl(from)?;
    (remaining != 0).then(|| remaining.trailing_zeros())
}

/// One field (a comma list of `*`, `a`, `a-b`, each optionally `/step`) as a bit set.
fn parse_field(text: &str, spec: &FieldSpec) -> Result<u64, CronError> {
    let mut bits = 0u64;
    for item in text.split(',') {
        if item.is_empty() {
            return Err(CronError::EmptyListItem { field: spec.name });
        }
        let (range, step) = match item.split_once('/') {
            Some((range, step)) => (range, Some(parse_step(step, spec)?)),
            None => (item, None),
        };
        let (start, end) = if range == "*" {
            (spec.min, spec.open_end)
        } else if let Some((start, end)) = range.split_once('-') {
            let (start, end) = (parse_value(start, item, spec)?, parse_value(end, item, spec)?);
            if start > end {
                return Err(CronError::BackwardRange { field: spec.name, start, end });
            }
            (start, end)
        } else {
            let start = parse_value(range, item, spec)?;
            (start, if step.is_some() { spec.open_end.max(start) } else { start })
        };
        for value in (start..=end).step_by(step.unwrap_or(1)) {
            bits |= 1 << value;
        }
    }
    Ok(bits)
}

fn parse_step(step: &str, spec: &FieldSpec) -> Result<usize, CronError> {
    let digits_only = step.bytes().all(|byte| byte.is_ascii_digit());
    let value = step.parse::<usize>().ok().filter(|&value| digits_only && value >= 1);
    value.ok_or_else(|| CronError::InvalidStep { field: spec.name, step: step.to_string() })
}

/// A number in the field's range, or (month, day-of-week) a case-insensitive name.
fn parse_value(token: &str, item: &str, spec: &FieldSpec) -> Result<u32, CronError> {
    if !token.is_empty() && token.bytes().all(|byte| byte.is_ascii_digit()) {
        let out_of_range = || CronError::OutOfRange { field: spec.name, value: token.to_string(), min: spec.min, max: spec.max };
        let value = token.parse::<u32>().map_err(|_| out_of_range())?;
        return (spec.min..=spec.max).contains(&value).then_some(value).ok_or_else(out_of_range);
    }
    (spec.min..)
        .zip(spec.names)
        .find(|(_, name)| name.eq_ignore_ascii_case(token))
        .map(|(value, _)| value)
        .ok_or_else(|| CronError::InvalidItem { field: spec.name, item: item.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> i64 {
        DateTime::parse_from_rfc3339(text).unwrap().timestamp_millis()
    }

    fn utc_text(ms: i64) -> String {
        DateTime::from_timestamp_millis(ms).unwrap().format("%Y-%m-%dT%H:%M:%SZ").to_string()
    }

    /// The next firing of `expression` in `tz` after `after`, in UTC.
    fn next_in(expression: &str, tz: Tz, after: &str) -> String {
        utc_text(Cron::parse(expression).unwrap().next_after(ms(after), tz).unwrap())
    }

    fn next(expression: &str, after: &str) -> String {
        next_in(expression, Tz::UTC, after)
    }

    /// The first `count` firings after `after`, in UTC.
    fn firings(expression: &str, tz: Tz, after: &str, count: usize) -> Vec<String> {
        let cron = Cron::parse(expression).unwrap();
        std::iter::successors(Some(ms(after)), |&at| cron.next_after(at, tz)).skip(1).take(count).map(utc_text).collect()
    }

    fn values(bits: u64) -> Vec<u32> {
        (0..64).filter(|bit| bits >> bit & 1 == 1).collect()
    }

    fn minutes(field: &str) -> Vec<u32> {
        values(Cron::parse(&format!("{field} * * * *")).unwrap().minutes)
    }

    fn error(expression: &str) -> String {
        Cron::parse(expression).unwrap_err().to_string()
    }

    #[test]
    fn each_syntax_form() {
        assert_eq!(minutes("*"), (0..60).collect::<Vec<_>>());
        assert_eq!(minutes("7"), [7]);
        assert_eq!(minutes("10-13"), [10, 11, 12, 13]);
        assert_eq!(minutes("*/20"), [0, 20, 40]);
        assert_eq!(minutes("10-30/10"), [10, 20, 30]);
        assert_eq!(minutes("50/3"), [50, 53, 56, 59]);
        assert_eq!(minutes("1,5-6,*/30,45/100"), [0, 1, 5, 6, 30, 45]);
        assert_eq!(values(Cron::parse("0 */5 * * *").unwrap().hours), [0, 5, 10, 15, 20]);
        assert_eq!(values(Cron::parse("0 0 */10 * *").unwrap().days_of_month), [1, 11, 21, 31]);
        assert_eq!(values(Cron::parse("0 0 * * 1/2").unwrap().days_of_week), [1, 3, 5]);
        assert_eq!(next("10-30/10 9 * * *", "2025-06-02T09:20:00Z"), "2025-06-02T09:30:00Z");
        assert_eq!(next("10-30/10 9 * * *", "2025-06-02T09:30:00Z"), "2025-06-03T09:10:00Z");
    }

    #[test]
    fn names_whitespace_macros_and_display() {
        let cron = Cron::parse("0 0 1 jan-mar,DEC Mon-fri").unwrap();
        assert_eq!(values(cron.months), [1, 2, 3, 12]);
        assert_eq!(values(cron.days_of_week), [1, 2, 3, 4, 5]);
        let cron: Cron = " \t0   9\t* *  1-5 ".parse().unwrap();
        assert_eq!(cron.to_string(), "0 9 * * 1-5");
        assert_eq!(cron, Cron::parse("0 9 * * 1-5").unwrap());
        for (name, fields) in [
            ("@yearly", "0 0 1 1 *"),
            ("@annually", "0 0 1 1 *"),
            ("@monthly", "0 0 1 * *"),
            ("@weekly", "0 0 * * 0"),
            ("@daily", "0 0 * * *"),
            ("@MIDNIGHT", "0 0 * * *"),
            ("@hourly", "0 * * * *"),
        ] {
            let (from_macro, plain) = (Cron::parse(name).unwrap(), Cron::parse(fields).unwrap());
            assert_eq!(from_macro.to_string(), name);
            assert_eq!(Cron { expression: fields.to_string(), ..from_macro }, plain, "{name}");
        }
    }

    #[test]
    fn seven_is_sunday() {
        let sunday = Cron::parse("0 0 * * 0").unwrap().days_of_week;
        assert_eq!(Cron::parse("0 0 * * 7").unwrap().days_of_week, sunday);
        assert_eq!(Cron::parse("0 0 * * sun").unwrap().days_of_week, sunday);
        assert_eq!(values(Cron::parse("0 0 * * 5-7").unwrap().days_of_week), [0, 5, 6]);
        assert_eq!(next("0 0 * * 7", "2025-06-02T00:00:00Z"), "2025-06-08T00:00:00Z");
    }

    #[test]
    fn day_of_month_or_day_of_week_when_both_restricted() {
        // January 2025: Fridays are the 3rd, 10th, 17th, 24th and 31st; the 13th is a Monday.
        let either = firings("0 0 13 * 5", Tz::UTC, "2025-01-01T00:00:00Z", 4);
        assert_eq!(either, ["2025-01-03T00:00:00Z", "2025-01-10T00:00:00Z", "2025-01-13T00:00:00Z", "2025-01-17T00:00:00Z"]);
        // A field starting with `*` makes both required: odd days that are Fridays.
        let both = firings("0 0 */2 * 5", Tz::UTC, "2025-01-01T00:00:00Z", 3);
        assert_eq!(both, ["2025-01-03T00:00:00Z", "2025-01-17T00:00:00Z", "2025-01-31T00:00:00Z"]);
        assert_eq!(next("0 0 13 * *", "2025-01-01T00:00:00Z"), "2025-01-13T00:00:00Z");
    }

    #[test]
    fn strictly_after_on_whole_minutes() {
        assert_eq!(next("* * * * *", "2025-06-02T10:00:30.500Z"), "2025-06-02T10:01:00Z");
        assert_eq!(next("* * * * *", "2025-06-02T10:00:00Z"), "2025-06-02T10:01:00Z");
        assert_eq!(next("0 9 * * *", "2025-06-02T09:00:00Z"), "2025-06-03T09:00:00Z");
        assert_eq!(Cron::parse("* * * * *").unwrap().next_after(-1, Tz::UTC), Some(0));
    }

    #[test]
    fn month_ends_and_leap_years() {
        assert_eq!(next("0 0 31 * *", "2025-04-01T00:00:00Z"), "2025-05-31T00:00:00Z");
        assert_eq!(next("0 0 29 2 *", "2025-01-01T00:00:00Z"), "2028-02-29T00:00:00Z");
        assert_eq!(next("0 0 29 2 *", "2096-03-01T00:00:00Z"), "2104-02-29T00:00:00Z");
        // Feb 29 on a Sunday: 2088, then 2128 — why the search spans the 400-year cycle.
        assert_eq!(next("0 0 29 2 */7", "2089-01-01T00:00:00Z"), "2128-02-29T00:00:00Z");
    }

    #[test]
    fn time_zones() {
        let new_york = parse_timezone("America/New_York").unwrap();
        assert_eq!(next_in("0 9 * * *", new_york, "2025-01-15T00:00:00Z"), "2025-01-15T14:00:00Z");
        assert_eq!(next_in("0 9 * * *", new_york, "2025-07-15T00:00:00Z"), "2025-07-15T13:00:00Z");
        let kolkata = parse_timezone("Asia/Kolkata").unwrap();
        assert_eq!(next_in("0 9 * * *", kolkata, "2025-07-15T00:00:00Z"), "2025-07-15T03:30:00Z");
        assert_eq!(parse_timezone("UTC"), Ok(Tz::UTC));
        assert_eq!(parse_timezone("Europe/Paris"), Ok(Tz::Europe__Paris));
    }

    #[test]
    fn dst_gap_is_skipped_and_repeated_hour_fires_once_at_the_earlier_instant() {
        // Berlin springs from 02:00 CET to 03:00 CEST on 2025-03-30: 02:30 does not exist that day.
        let berlin = Tz::Europe__Berlin;
        assert_eq!(next_in("30 2 * * *", berlin, "2025-03-29T12:00:00Z"), "2025-03-31T00:30:00Z");
        assert_eq!(next_in("*/30 * * * *", berlin, "2025-03-30T00:45:00Z"), "2025-03-30T01:00:00Z");
        // It falls back from 03:00 CEST to 02:00 CET on 2025-10-26: 02:30 happens twice, fires once.
        let fired = firings("30 2 * * *", berlin, "2025-10-25T12:00:00Z", 2);
        assert_eq!(fired, ["2025-10-26T00:30:00Z", "2025-10-27T01:30:00Z"]);
        // Asked during the second pass, the repeated minute has already fired.
        assert_eq!(next_in("30 2 * * *", berlin, "2025-10-26T01:00:00Z"), "2025-10-27T01:30:00Z");
        assert_eq!(next_in("*/30 * * * *", berlin, "2025-10-26T00:30:00Z"), "2025-10-26T02:00:00Z");
    }

    #[test]
    fn rejections_say_what_is_wrong() {
        let fields = "(minute hour day-of-month month day-of-week)";
        assert_eq!(error("0 0 * *"), format!("cron expression needs 5 fields {fields}, found 4"));
        assert_eq!(error("  "), format!("cron expression needs 5 fields {fields}, found 0"));
        assert_eq!(error("@often"), "unknown cron macro `@often`; use @yearly, @annually, @monthly, @weekly, @daily, @midnight or @hourly");
        assert_eq!(error("1,,2 * * * *"), "the minute field has an empty item in its comma-separated list");
        assert_eq!(error("0 0 * * 1,"), "the day-of-week field has an empty item in its comma-separated list");
        assert_eq!(error("*/0 * * * *"), "the minute field's step `0` must be a whole number of at least 1");
        assert_eq!(error("0 1-5/x * * *"), "the hour field's step `x` must be a whole number of at least 1");
        assert_eq!(error("5-1 * * * *"), "the minute field's range 5-1 starts after it ends");
        assert_eq!(error("0 0 * dec-jan *"), "the month field's range 12-1 starts after it ends");
        assert_eq!(error("60 * * * *"), "the minute field's value 60 is out of its range 0-59");
        assert_eq!(error("0 24 * * *"), "the hour field's value 24 is out of its range 0-23");
        assert_eq!(error("0 0 0 * *"), "the day-of-month field's value 0 is out of its range 1-31");
        assert_eq!(error("0 0 * 13 *"), "the month field's value 13 is out of its range 1-12");
        assert_eq!(error("0 0 * * 8"), "the day-of-week field's value 8 is out of its range 0-7");
        assert_eq!(error("99999999999 * * * *"), "the minute field's value 99999999999 is out of its range 0-59");
        assert_eq!(error("abc * * * *"), "the minute field's `abc` is not a number, name, range or step");
        assert_eq!(error("0 0 ? * *"), "the day-of-month field's `?` is not a number, name, range or step");
        assert_eq!(error("-5 * * * *"), "the minute field's `-5` is not a number, name, range or step");
        assert_eq!(error("0 0 * * mon-fry"), "the day-of-week field's `mon-fry` is not a number, name, range or step");
        assert_eq!(error("0 jan * * 9"), "the hour field's `jan` is not a number, name, range or step");
        let long = format!("0 0 * * {}", vec!["1"; 130].join(","));
        assert_eq!(error(&long), "cron expression is 267 characters long; at most 256 are allowed");
        assert_eq!(error("0 0 30 2 *"), "cron expression `0 0 30 2 *` can never fire: no date matches its day and month fields");
        assert!(error("0 0 31 4,6,9,11 *").contains("can never fire"));
        let bad_zone = parse_timezone("Mars/Olympus").unwrap_err();
        assert_eq!(bad_zone.to_string(), "unknown time zone `Mars/Olympus`; use an IANA name such as `Europe/Paris` or `UTC`");
        assert!(Cron::parse("0 0 29 2 *").is_ok());
    }

    /// Counts firings over calendar 2025 in `tz` (a non-leap year); also guards the skipping.
    fn firings_in_2025(expression: &str, tz: Tz) -> usize {
        let cron = Cron::parse(expression).unwrap();
        let year_start = |year| tz.with_ymd_and_hms(year, 1, 1, 0, 0, 0).unwrap().timestamp_millis();
        let (mut at, end) = (year_start(2025) - 1, year_start(2026));
        let mut count = 0;
        while let Some(next) = cron.next_after(at, tz).filter(|&next| next < end) {
            assert!(next > at && next % MINUTE_MS == 0);
            (at, count) = (next, count + 1);
        }
        count
    }

    #[test]
    fn year_long_walk() {
        assert_eq!(firings_in_2025("*/15 * * * *", Tz::UTC), 4 * 24 * 365);
        // Berlin's wall clock: the spring gap loses 4 slots; the repeated autumn hour fires once.
        assert_eq!(firings_in_2025("*/15 * * * *", Tz::Europe__Berlin), 4 * 24 * 365 - 4);
        assert_eq!(firings_in_2025("0 9 29 2 *", Tz::UTC), 0);
        assert_eq!(firings_in_2025("@weekly", Tz::UTC), 52);
    }
}
